"""CUDA graphs over the decoder-layer stack of a shared-prefix training step (issue 15).

A step's host work (Python, launch overhead of a few thousand small kernels) is replaced by two graph
replays, one forward and one backward, for every batch whose layout has been captured before:

- `signature.py`: the key of a call, everything the captured kernels baked in (shapes, host ints,
  the plan's segment layout, parameter storage);
- `static.py`: the static copy of a call's arguments a graph reads, and the copies that load a
  batch into it;
- `replay.py`: capture (warm-up, private memory pool, forward and backward graphs) and the autograd
  node that replays them; an eager replay of the same static buffers for tests off CUDA;
- `cache.py`: the bounded cache of captured stacks and its counters.

`patchgen.kernels.modeling.layer_graphs` decides per forward whether the stack runs here.
"""

from .cache import GraphCache, GraphStats
from .replay import CudaGraphReplay, EagerReplay, StackReplay
from .signature import call_signature, plan_signature
from .static import StaticCall

__all__ = [
    "CudaGraphReplay",
    "EagerReplay",
    "GraphCache",
    "GraphStats",
    "StackReplay",
    "StaticCall",
    "call_signature",
    "plan_signature",
]
