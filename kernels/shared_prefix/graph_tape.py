"""A layer's capture split at its linears: CUDA graphs of everything between them, the linears run eagerly on the
weights of the layer being replayed.

A layer graph (`modeling/scoring_layers.py`) replays for every layer of a kind; a CUDA graph reads the addresses it
was captured on, so each replay used to copy the layer's weights into the captured layer's static copies first: at
32 layers of 4B widths, n=4 P=2048 on the H200, about 4.9 ms of a 58 ms scoring forward's device time went to those
copies (`multi_tensor_apply_kernel`, docs/bench, eleventh session), and the copies held one layer's weights per kind.
Nearly all of a layer's weight bytes are its linears' weights, and a linear is one cuBLAS call: one launch, where
the rest of a layer is dozens. So the linears are left out of the graphs: the capture ends before each linear and
begins again after it, and a replay runs the graphs in order with each linear in between, as `mm` into the buffer
the next graph reads, on the replayed layer's own weight. The linears' weights are never copied; the small ones
(norms, the conv's taps, the gates' biases) still are.

The output is the eager layer's bit for bit: a bias-free `F.linear` on an input of two or more dimensions is
`matmul`, which folds the leading dimensions and calls `mm` (where they fold without a copy; otherwise it takes
`bmm`, and the capture refuses), and a replay calls the same `mm` on the same rows, under autocast on the same
casts. During the capture the linears' weights are `Placeholder`s on the meta device: a layer that reads a weight
other than through `F.linear` or for its metadata (a custom matmul on it) fails the capture loudly rather than
replay another layer's weights. Its metadata is the real weight's, and so is every read of it from a thread other
than the capturing one: `functional_call` swaps the placeholders into the shared module, where another thread may
run the layer meanwhile. Autocast's casts are the ones it makes: none of a float64 operand.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_map_only

EMPTY_GRAPH = "The CUDA Graph is empty"  # torch's warning at the end of a capture between two linears in a row (q, k, v)


# what a layer may read of a linear's weight besides handing it to F.linear: its metadata
METADATA = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in ("shape", "dtype", "device", "requires_grad", "ndim", "is_cuda",
                                                       "layout", "is_meta")]
    + [torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
       torch.Tensor.is_floating_point]
)


class Placeholder(torch.Tensor):
    """A linear's weight during the capture: on the meta device, and taken out of `F.linear` by the tape."""

    tape: Tape
    at: int  # its position among the live weights
    weight: torch.Tensor  # the weight it stands for (not `real`: a tensor property)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA or not _capturing(args, kwargs):
            # its metadata is the real weight's (a layer may branch on the device or on requires_grad, or make
            # tensors on the weight's device); and `functional_call` swaps the module's weights in place, so
            # another thread running the layer as it is meanwhile (a second scoring thread's eager layer) must
            # compute on its real weights, not hand its linears to this tape
            return func(*_real(args), **_real(kwargs))
        if func is torch.nn.functional.linear:
            x, weight = args[0] if args else kwargs["input"], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, Placeholder) and bias is None and not isinstance(x, Placeholder):
                return weight.tape.linear(x, weight)
        # a kernel on the weight: the capture would bake the captured layer's in
        raise TypeError(f"{getattr(func, '__qualname__', func)} reads a linear's weight outside F.linear: the "
                        "layer cannot replay on other layers' weights")


def _weight_of(held: Placeholder) -> torch.Tensor:
    return held.weight


# Every call a layer makes on a placeholder comes here, a dozen and more per capture (each linear, each read of a
# weight's shape or dtype). torch's pytree walks took about 40 us a call on the H200's host under the profiler (a
# wrapper made per `tree_map_only`, its spec built and unflattened), a good part of a capture's host time beyond the
# layer's own; the arguments are nearly always flat, which a plain scan serves. Anything nested goes to pytree.
FLAT = (tuple, list, dict)


def _flat(values) -> bool:
    return not any(isinstance(value, FLAT) for value in values)


def _real(args):
    """`args` (a tuple of positional arguments or a dict of keyword ones) with every placeholder its real weight."""
    if isinstance(args, dict):
        if _flat(args.values()):
            return {name: value.weight if isinstance(value, Placeholder) else value for name, value in args.items()}
    elif _flat(args):
        return tuple(value.weight if isinstance(value, Placeholder) else value for value in args)
    return tree_map_only(Placeholder, _weight_of, args)


def _placeholders(args, kwargs) -> list:
    if _flat(args) and _flat(kwargs.values()):
        return [value for value in (*args, *kwargs.values()) if isinstance(value, Placeholder)]
    found = []
    tree_map_only(Placeholder, found.append, (args, kwargs))
    return found


def _capturing(args, kwargs) -> bool:
    """Whether this call is the capturing thread's (a placeholder among the arguments on the tape this thread
    records)."""
    this = threading.get_ident()
    return all(held.tape.thread == this for held in _placeholders(args, kwargs))


def placeholder(weight: torch.Tensor, tape: Tape, at: int) -> Placeholder:
    found = torch.Tensor._make_subclass(Placeholder, torch.empty_like(weight, device="meta"))
    found.tape, found.at, found.weight = tape, at, weight
    return found


def folds(x: torch.Tensor) -> bool:
    """Whether `matmul` folds `x`'s leading dimensions into rows without a copy (its `should_fold` for a 2-D right
    operand): then a bias-free linear is one `mm`, which the replay calls again."""
    return x.dim() == 2 or all(x.stride(i) == x.stride(i + 1) * x.size(i + 1) for i in range(x.dim() - 2))


def _autocast_to(dtype: torch.dtype, device: str) -> torch.dtype | None:
    """The dtype autocast casts an `F.linear` operand of `dtype` to, or None where it leaves it: off, or not a
    floating type, or float64, which autocast never casts (a float64 layer's linears stay float64 under it)."""
    if not torch.is_autocast_enabled(device) or not dtype.is_floating_point or dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device)


class _Linear:
    """One linear of the tape: `out = x @ live[at].T`, cast first as autocast cast it at capture."""

    def __init__(self, x: torch.Tensor, at: int, cast: torch.dtype | None, out: torch.Tensor):
        self.x, self.at, self.cast, self.out = x, at, cast, out
        self.out_rows = out.view(-1, out.shape[-1])
        # the input's rows, a view made once (`folds`), unless autocast casts a copy of it at every replay
        self.rows = x.reshape(-1, x.shape[-1]) if cast in (None, x.dtype) else None

    def run(self, live: Sequence[torch.Tensor]) -> None:
        weight = live[self.at]
        if self.cast is not None and weight.dtype != self.cast:
            weight = weight.to(self.cast)
        rows = self.rows if self.rows is not None else self.x.to(self.cast).reshape(-1, self.x.shape[-1])
        torch.mm(rows, weight.t(), out=self.out_rows)


class Tape:
    """The graphs and linears of one capture, in order (see the module docstring)."""

    def __init__(self, pool, replay_stream, graph_type=torch.cuda.CUDAGraph):
        self.pool, self.replay_stream, self.graph_type = pool, replay_stream, graph_type
        self.steps: list = []
        self.idle: list = []  # the empty graphs, held (`_end`)
        self._open = None
        self.thread = None  # the recording thread's id

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The linears' outputs, made outside the graphs' pool on the replay stream."""
        return [step.out for step in self.steps if isinstance(step, _Linear)]

    def record(self, body: Callable, statics: Sequence[torch.Tensor], live: Sequence[torch.Tensor]):
        """Capture `body(*statics, *live)` with the linears on `live` taken out; the output tensor."""
        self.thread = threading.get_ident()
        placeholders = [placeholder(w, self, i) for i, w in enumerate(live)]
        self._begin()
        try:
            out = body(*statics, *placeholders)
        finally:
            self._end()
        if not isinstance(out, torch.Tensor) or isinstance(out, Placeholder) or out.device != statics[0].device:
            raise TypeError(f"the captured layer returned {type(out).__name__} on {getattr(out, 'device', None)}, "
                            f"not a tensor on {statics[0].device}")
        return out

    def linear(self, x: torch.Tensor, held: Placeholder) -> torch.Tensor:
        weight = held.weight  # its metadata read from the real weight: through the placeholder, each read is a dispatch
        if isinstance(x, Placeholder) or x.device.type == "meta" or x.dim() < 2 or not folds(x):
            raise TypeError(f"a linear on an input the tape cannot replay as one mm ({x.device}, shape "
                            f"{tuple(x.shape)}, strides {x.stride()})")
        cast_x, cast_weight = _autocast_to(x.dtype, x.device.type), _autocast_to(weight.dtype, x.device.type)
        if (cast_x or x.dtype) != (cast_weight or weight.dtype):
            raise TypeError(f"a linear of a {x.dtype} input on a {weight.dtype} weight")
        cast = cast_x or cast_weight
        self._end()
        with torch.cuda.stream(self.replay_stream):  # outside the pool, where the replays write it
            out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=cast or x.dtype, device=x.device)
        self.steps.append(_Linear(x, held.at, cast, out))
        self._begin()
        return out

    def replay(self, *live: torch.Tensor) -> None:
        for step in self.steps:
            if isinstance(step, _Linear):
                step.run(live)
            else:
                step.replay()

    def _begin(self) -> None:
        self._open = self.graph_type()
        # thread_local: the capture fails only on what this thread does
        self._open.capture_begin(pool=None if self.pool is None else self.pool.id, capture_error_mode="thread_local")

    def _end(self) -> None:
        graph, self._open = self._open, None
        if graph is None:  # a linear failed between two graphs
            return
        # torch's warning that the capture is empty, raised instead: it comes when the C++ `capture_end` has done all its
        # work (what torch's Python wrapper does after it, stopping an input-liveness tracker, has nothing to do here:
        # the capture starts none), in this thread only (another thread's empty capture meanwhile raises in that
        # thread, never passes for ours)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=EMPTY_GRAPH)
            try:
                graph.capture_end()
                empty = False
            except UserWarning as warning:
                if EMPTY_GRAPH not in str(warning):
                    raise
                empty = True
        # an empty graph (between two linears in a row) is kept, not replayed: its launch would cost the host a few us
        # at every replay for nothing, and it goes with the tape's other graphs
        (self.idle if empty else self.steps).append(graph)
