"""Capture and replay of the layer stack: forward and backward graphs, and the autograd node around them.

`CudaGraphReplay` captures, on a side stream, one forward graph (the layers under autograd, as eager)
and one backward graph (`torch.autograd.grad` of the stack's output with respect to the hidden states
and every parameter that wants a gradient), both in one private memory pool that the entry owns:

1. warm-up steps on the static arguments with the private pool active for every thread (the backward
   runs on autograd's device thread; `allocating_to`): Triton autotuning and every
   lazily built state happen before the capture, and whatever a kernel library computes from the static
   plan's tensors and caches by tensor identity (fla's chunk tables) is allocated in the pool, so the
   memory the graph reads stays valid for as long as the entry lives, whether or not the library's
   cache still holds it (memory a global cache keeps, a stream's cuBLAS workspace, stays allocated and
   valid after the entry goes; it is only accounted to its pool);
   Warm-ups and captures run with autocast's cast cache off (`uncached_autocast`), so that the weight
   casts are captured and every replay casts the current weights;
2. the captures, which hit those caches. A miss under capture recomputes the table inside the graph
   (in its pool, so valid too) or, where that needs a host copy, fails the capture loudly
   (`GraphCaptureFailed`, raised with the device put back as it was: `shared_prefix.capture_failure`); it never
   leaves the graph reading memory it does not own.

No autograd node made on the side stream outlives the capture (the static output is detached), so the
parameters' `AccumulateGrad` nodes are made again on the training stream by the first replay: no
"AccumulateGrad node's stream does not match" warning, no cross-stream wait.

`StackReplay` is the autograd node of one replay. Its backward returns the static gradient buffers
themselves: autograd adds them into `.grad` (or, when `.grad` is None, stores a copy: the buffer is
still referenced by the entry, so it is never stolen), and every post-accumulate hook on the parameters
(DDP's gradient-ready hooks) fires once, as in eager (tensor hooks, which the warm-ups' and captures' own
backward would fire too, are refused by `layer_graphs`). A backward whose forward was followed by another replay of
the same graph raises `GraphReplayOverwritten` instead of returning another batch's gradients.
`EagerReplay` runs the same static buffers and node eagerly: the CPU tests' stand-in for the graphs.

A scoring forward (a plan, no gradient: the log-probs of an RL step's old policy or reference model)
has a graph of its own, forward only: `CudaGraphScoring` (`EagerScoring` off CUDA). It keeps no
activations between calls, so its pool holds one forward's working memory.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.autograd.function import once_differentiable

from ..errors import CudaGraphsUnavailable, GraphCaptureFailed, GraphReplayOverwritten
from ..shared_prefix import call_graphs
from ..shared_prefix.capture_failure import restore_after_failed_capture
from .static import StaticCall


def run_stack(fn, hidden, position_embeddings, masks, kwargs) -> torch.Tensor:
    return fn(hidden, position_embeddings, masks, **kwargs)


@contextlib.contextmanager
def uncached_autocast(device_type: str):
    """Autocast as the caller has it, but without its cast cache, for the warm-ups and the captures.

    Under autocast with its cache on (the default; HF Trainer's ``bf16=True`` on float32 weights), the
    first cast of a weight is kept for the rest of the autocast region and later casts are cache hits.
    A capture after the warm-ups would then record no cast kernel, and every replay would read the copy
    the warm-up made: the weights as they were at capture, whatever the optimizer did since (torch's
    ``make_graphed_callables`` refuses the cache for this reason). With the cache off the casts are
    captured and every replay casts the current weights, as every eager step does."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False):
        yield


def _grad_inputs(static: StaticCall, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return ([static.hidden] if static.hidden.requires_grad else []) + list(params)


class EagerReplay:
    """The layer stack run eagerly on the static buffers (same node, same buffers as the graphs; any device)."""

    kind = "eager"

    def __init__(self, fn, static: StaticCall, params: list[torch.Tensor]):
        self.fn, self.static, self.params = fn, static, params
        self._out = None
        self._grads = None

    def forward(self) -> torch.Tensor:
        s = self.static
        with torch.enable_grad():
            self._out = run_stack(self.fn, s.hidden, s.position_embeddings, s.masks, s.kwargs)
        return self._out.detach()

    def backward(self, grad: torch.Tensor) -> tuple:
        inputs = _grad_inputs(self.static, self.params)
        found = torch.autograd.grad(self._out, inputs, grad, allow_unused=True)
        self._out = None
        # into buffers kept across calls, as a graph's outputs are: what autograd does with them is then
        # what it does with the graph's (a stolen buffer would show as a wrong accumulated gradient)
        if self._grads is None:
            self._grads = tuple(None if g is None else torch.empty_like(g) for g in found)
        for buffer, g in zip(self._grads, found):
            if buffer is not None:
                buffer.copy_(g)
        return self._grads


_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every warm-up and capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def _step(fn, hidden, position_embeddings, masks, kwargs, params) -> None:
    """One forward and backward of the stack (warm-up); nothing of its autograd graph survives."""
    with torch.enable_grad():
        out = run_stack(fn, hidden, position_embeddings, masks, kwargs)
        inputs = ([hidden] if hidden.requires_grad else []) + list(params)
        torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)


OUTSIDE = ("/torch/", "/triton/")


def failure_site(error: BaseException) -> str:
    """The innermost frames of `error` outside torch and Triton: the op that could not be captured and its caller."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not any(o in f.filename for o in OUTSIDE)]
    if not frames:
        return "no Python frame outside torch"
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-2:]))


@contextlib.contextmanager
def allocating_to(pool, device: torch.device):
    """Every allocation on `device` inside the block comes from `pool`, whatever its thread or stream.

    `torch.cuda.use_mem_pool` routes the calling thread's allocations only, and a CUDA backward runs on
    autograd's device thread: what a kernel library caches from inside the backward would land outside
    the pool. This is the allocator hook `use_mem_pool` is built on, with its all-threads filter."""
    begin = getattr(torch._C, "_cuda_beginAllocateToPool", None)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if begin is None or end is None or release is None:
        raise CudaGraphsUnavailable(
            f"shared_prefix_cuda_graphs needs torch's allocator pool routing (torch._C._cuda_beginAllocateToPool, "
            f"_cuda_endAllocateToPool, _cuda_releasePool), which torch {torch.__version__} lacks: use torch >= 2.8 "
            "or set shared_prefix_cuda_graphs=False"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    # a scoring forward's call graphs would be captured into this pool too (`call_graphs.CallGraphs.held_off`)
    with call_graphs.held_off():
        begin(index, pool.id)
        try:
            yield
        finally:
            end(index, pool.id)
            release(index, pool.id)


def _capture_failed(error: BaseException, device: torch.device, pool, stream) -> GraphCaptureFailed:
    """The error to raise for a failed capture into this stack's own `pool`, with the device put back as it was
    (`restore_after_failed_capture`): a user who turns the graphs off and goes on finds its random ops working."""
    restore_after_failed_capture(device, pool=pool.id, stream=stream,
                                 off="set shared_prefix_cuda_graphs=False (or PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS=0)")
    return GraphCaptureFailed(
        f"shared_prefix_cuda_graphs: capturing the decoder-layer stack failed at {failure_site(error)}: "
        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}. Something inside the "
        "layers synchronises with the host or copies host data per call (an MoE experts backend that reads "
        "token counts, a kernel library that rebuilt a cached table): that path cannot run under CUDA graphs. "
        "Set shared_prefix_cuda_graphs=False (or PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS=0), or choose a backend "
        "for that op slot that does not sync"
    )


def _need_mem_pool() -> None:
    if not hasattr(torch.cuda, "MemPool"):
        raise CudaGraphsUnavailable(
            f"shared_prefix_cuda_graphs needs torch.cuda.MemPool (torch >= 2.8); found torch {torch.__version__}: "
            "upgrade torch or set shared_prefix_cuda_graphs=False"
        )


class CudaGraphReplay:
    """Forward and backward graphs of the layer stack on `static`'s buffers, in a private pool (see module docstring)."""

    kind = "cuda"

    def __init__(self, fn, static: StaticCall, params: list[torch.Tensor], warmup: int = 2):
        _need_mem_pool()
        # `fn` is not kept: it closes over the text model, which holds this cache (a cycle only gc would free)
        device = static.hidden.device
        stream = capture_stream(device)
        inputs = _grad_inputs(static, params)
        with torch.cuda.device(device):
            self.pool = torch.cuda.MemPool()
            self._capture(fn, static, params, inputs, device, stream, warmup)

    def _capture(self, fn, static, params, inputs, device, stream, warmup) -> None:
        # eager steps: an error here (out of memory, a bad shape) is the eager step's own, raised as it is
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), allocating_to(self.pool, device), uncached_autocast(device.type):
            for _ in range(warmup):
                _step(fn, static.hidden, static.position_embeddings, static.masks, static.kwargs, params)
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        try:
            self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.enable_grad(), uncached_autocast(device.type):
                with torch.cuda.graph(self.forward_graph, pool=self.pool.id, stream=stream, capture_error_mode="thread_local"):
                    out = run_stack(fn, static.hidden, static.position_embeddings, static.masks, static.kwargs)
                self.grad_out = torch.empty_like(out)
                with torch.cuda.graph(self.backward_graph, pool=self.pool.id, stream=stream, capture_error_mode="thread_local"):
                    grads = torch.autograd.grad(out, inputs, self.grad_out, allow_unused=True)
        except Exception as error:
            raise _capture_failed(error, device, self.pool, current) from error
        # the captured autograd graph (and its AccumulateGrad nodes, made on the side stream) goes now
        self.out = out.detach()
        del out
        self.grads = grads

    def forward(self) -> torch.Tensor:
        self.forward_graph.replay()
        return self.out

    def __del__(self):
        # graphs before their pool: some torch releases assert, when a MemPool goes, that no graph holds it
        for name in ("forward_graph", "backward_graph"):
            graph = self.__dict__.pop(name, None)
            if graph is not None:
                with contextlib.suppress(Exception):  # a graph whose capture failed
                    graph.reset()
        self.__dict__.pop("out", None)
        self.__dict__.pop("grads", None)
        self.__dict__.pop("pool", None)

    def backward(self, grad: torch.Tensor) -> tuple:
        self.grad_out.copy_(grad)
        self.backward_graph.replay()
        return self.grads


class StackReplay(torch.autograd.Function):
    """One replay of a cache entry's stack: `(entry, hidden, *params) -> hidden out`; backward replays the gradients."""

    @staticmethod
    def forward(ctx, entry, hidden, *params):
        entry.static.hidden.detach().copy_(hidden)
        out = entry.replay.forward()
        entry.generation += 1
        ctx.entry, ctx.generation = entry, entry.generation
        ctx.hidden_grad = entry.static.hidden.requires_grad
        # a copy: the next replay overwrites the static output, the caller may hold this one
        return out.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        entry = ctx.entry
        if ctx.generation != entry.generation:
            raise GraphReplayOverwritten(
                "shared_prefix_cuda_graphs: the backward of a graphed layer stack ran after a later forward replayed "
                f"the same graph (forward {ctx.generation}, now {entry.generation}), which overwrote the activations "
                "this backward reads. Run each forward's backward before the next forward of the same shape (as a "
                "training step does), run the other forward under torch.no_grad(), or set shared_prefix_cuda_graphs=False"
            )
        found = list(entry.replay.backward(grad.contiguous()))
        hidden_grad = found.pop(0) if ctx.hidden_grad else None
        return (None, hidden_grad, *found)


class EagerScoring:
    """A scoring forward (no gradient) run eagerly on the static buffers: the CPU tests' stand-in for `CudaGraphScoring`."""

    kind = "eager"

    def __init__(self, fn, static: StaticCall):
        self.fn, self.static = fn, static

    def forward(self) -> torch.Tensor:
        s = self.static
        with torch.no_grad():
            return run_stack(self.fn, s.hidden, s.position_embeddings, s.masks, s.kwargs)


class CudaGraphScoring:
    """One forward graph of the layer stack without autograd (a scoring pass), in a private pool; warm-ups as
    for the training graphs (`CudaGraphReplay`), under ``torch.no_grad``."""

    kind = "cuda"

    def __init__(self, fn, static: StaticCall, warmup: int = 2):
        _need_mem_pool()
        device = static.hidden.device
        stream = capture_stream(device)
        with torch.cuda.device(device):
            self.pool = torch.cuda.MemPool()
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.no_grad(), torch.cuda.stream(stream), allocating_to(self.pool, device), uncached_autocast(device.type):
                for _ in range(warmup):
                    run_stack(fn, static.hidden, static.position_embeddings, static.masks, static.kwargs)
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            try:
                capture = torch.cuda.graph(self.graph, pool=self.pool.id, stream=stream, capture_error_mode="thread_local")
                with torch.no_grad(), uncached_autocast(device.type), capture:
                    self.out = run_stack(fn, static.hidden, static.position_embeddings, static.masks, static.kwargs)
            except Exception as error:
                raise _capture_failed(error, device, self.pool, current) from error

    def forward(self) -> torch.Tensor:
        self.graph.replay()
        return self.out

    def __del__(self):
        graph = self.__dict__.pop("graph", None)
        if graph is not None:
            with contextlib.suppress(Exception):
                graph.reset()
        self.__dict__.pop("out", None)
        self.__dict__.pop("pool", None)


def replay_scoring(entry, hidden: torch.Tensor) -> torch.Tensor:
    """One scoring replay of a cache entry: the batch's hidden states in, a copy of the stack's output out."""
    with torch.no_grad():
        entry.static.hidden.copy_(hidden)
        out = entry.replay.forward()
        entry.generation += 1
        return out.clone()  # the next replay overwrites the static output
