"""Causal depthwise conv1d on the compact row, in one varlen call whatever the depth of the prefix tree.

Two ways to give a segment (nested node or leaf) the `W-1` rows of its parent that its first outputs
read (a root or singleton reads zeros, as when packed; a nested node is at least W-1 rows long):
- initial state: every segment is one sequence of the call, its look-back rows are its initial conv
  state (one gather of those few rows forward, one index_add_ of their gradient into the parent's rows
  backward, the conv's output is the compact row as it is). For backends that expose state kernels
  (`conv_fn.look_back`: fla, the torch reference); `LookBackConv` ties them into one autograd node.
- gathered rows: `[last W-1 rows of its parent | its rows]` gathered in front of every segment, the
  look-back outputs dropped after (two gathers forward, two scatters backward). Any varlen backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import CudaGraphsUnavailable
from . import call_graphs, capture_guard
from .call_graphs import CALL_GRAPHS
from .gdn import chunk_indices, derived_tables_refused
from .layout import Layout
from .rows import Arena, interleave


@dataclass(frozen=True, eq=False)
class ConvIndex:
    src: torch.Tensor | None  # [rows] compact row of each conv input row (gathered path; None when padded)
    cu_seqlens: torch.Tensor | None  # [n + 1] int32 (gathered path)
    out_index: torch.Tensor | None  # [C] conv output row kept for each compact row (gathered path)
    kernel_size: int  # the largest conv kernel the look-back serves
    segment_cu: torch.Tensor  # [S + 1] int32: the non-empty segments, which tile the compact row (state path)
    segment_chunks: torch.Tensor  # [chunks, 2] int32: fla's chunk table of those segments (chunks of 64)
    state_rows: torch.Tensor  # [S, W] int64: compact row in state slot w (slot w is row w - W before the
    # segment's first row; slot 0 is never read), -1 where the segment has no such row (it reads zero)
    state_index: dict = field(default_factory=dict, repr=False)  # (W, D, layout) -> index tensors
    # padded plan (`bucket.py`): rows past the compact row that the padding segments read (copies of padding
    # rows), so that the state path's rows and chunks are bucket counts; None otherwise
    extra_src: torch.Tensor | None = None

    def state_gather(self, width: int, channels: int, layout: str):
        """Index tensors of a state of `width` taps in `layout`, built once per plan (then cached).

        "fla": `(flat, keep)`, flat element index into `x.view(-1)` and mask of the `[S, D, W]` state
        (slot 0 unread, fla's `initial_state`); "rows": the same for `[S, W-1, D]`, rows in time order;
        "x": `(rows, scatter)`, the `[S, W]` rows of x the kernels read (-1: zero) and the rows
        `[S * (W-1)]` their gradient goes to (0 where none: the kernels give those slots zero).
        """
        key = (width, channels, layout)
        found = self.state_index.get(key)
        if found is None:
            if capture_guard.guarded() or (self.state_rows.is_cuda and torch.cuda.is_current_stream_capturing()):
                # built under a capture, it would be written only by the graph's replays, in the graph's memory, and
                # kept with the plan for the eager calls after it
                raise capture_guard.NotWarm(f"the conv look-back's index {key} would be built under a capture")
            with torch.inference_mode(False):  # kept with the plan, which a later training forward may reuse
                found = self.state_index[key] = self._state_gather(width, channels, layout)
            # only once built: a key that fails (a layout no kernels read) would fail every later plan's build
            _WANTED[key] = None
        return found

    def build_wanted(self) -> None:
        """Build the index of every key a plan of this process was asked for, with the plan: a scoring forward's
        first layer of a kind may be captured (`capture_guard.py`), and a table cannot be built under a capture."""
        for key in list(_WANTED):
            if key[0] <= self.kernel_size:  # another model's wider conv: not this plan's to serve
                self.state_gather(*key)

    def _state_gather(self, width: int, channels: int, layout: str):
        rows = self.state_rows[:, self.kernel_size - width :]  # the last `width` slots
        keep, safe = rows >= 0, rows.clamp(min=0)
        d = torch.arange(channels, device=rows.device)
        if layout == "fla":
            found = (safe[:, None, :] * channels + d[None, :, None], keep[:, None, :])
        elif layout == "rows":
            found = (safe[:, 1:, None] * channels + d[None, None, :], keep[:, 1:, None])
        elif layout == "x":
            found = (rows, safe[:, 1:].reshape(-1))
        else:
            raise ValueError(f"state layout must be 'fla', 'rows' or 'x', got {layout!r}")
        return tuple(t.contiguous() for t in found)


def conv_host_index(layout: Layout, kernel_size: int, arena: Arena | None = None) -> dict:
    """Host arrays of the one conv call, written into `arena` when given; uploaded by the plan builder."""
    arena = arena or Arena()
    segs, length, back, parent_end, rows = look_back(layout, kernel_size)
    seq_lengths = back + length
    kept_from = seq_lengths.cumsum() - seq_lengths + back  # conv output row of each segment's first row
    starts = interleave(parent_end - back, layout.start[segs])
    return {
        "kernel_size": kernel_size,
        "src": arena.ranges(starts, interleave(back, length)),
        "cu": arena.boundaries(seq_lengths),
        "out_index": arena.ranges(kept_from, length),  # non-empty segments tile the compact row in order
        "segment_cu": arena.boundaries(length),
        "segment_chunks": chunk_indices(length, arena, np.int32),
        "state_rows": arena.put(rows),
    }


def look_back(layout: Layout, kernel_size: int):
    """Per non-empty segment (they tile the compact row in order): the segments, their lengths, look-back
    rows, the compact row past their parent's last row, and the `[S, W]` state rows (see `ConvIndex`)."""
    segs = (layout.length > 0).nonzero()[0]
    length, offset, parent = layout.length[segs], layout.offset[segs], layout.parent[segs]
    has_parent = parent >= 0
    up = np.maximum(parent, 0)
    # a nested node is at least the conv look-back long, a root may be shorter only when the
    # sequence starts there: the parent alone then holds every look-back row there is
    back = np.where(has_parent, np.minimum(kernel_size - 1, offset), 0)
    short = has_parent & (back > layout.length[up])
    if short.any():
        raise AssertionError(f"a nested node shorter than the conv look-back (segment {int(segs[short][0])})")
    parent_end = layout.start[up] + layout.length[up]
    if not (layout.start[segs] == length.cumsum() - length).all():
        raise AssertionError("the non-empty segments do not tile the compact row in order")
    # state slot w (of W) holds the row W - w before the segment's first row: parent_end - (W - w)
    slot = np.arange(kernel_size, dtype=np.int64)[None, :]
    keep = (slot >= kernel_size - back[:, None]) & (slot > 0)
    rows = np.where(keep, parent_end[:, None] - kernel_size + slot, -1)
    return segs, length, back, parent_end, rows


def conv_index(host: dict, dev: dict) -> ConvIndex:
    idx = ConvIndex(
        dev.get("src"), dev.get("cu"), dev.get("out_index"), host["kernel_size"], dev["segment_cu"],
        dev["segment_chunks"], dev["state_rows"], extra_src=dev.get("extra_src"),
    )
    idx.build_wanted()
    return idx


# the (width, channels, layout) keys of `ConvIndex.state_gather` asked for in this process, in order (a model's conv
# asks for one): every plan builds them with itself
_WANTED: dict[tuple, None] = {}


def look_back_kernels(conv_fn, dtype: torch.dtype):
    """The state kernels behind an op table's `causal_conv1d` for inputs of `dtype`, if its backend has them."""
    function_for = getattr(conv_fn, "function_for", None)  # a DtypeDispatch slot: the backend serving this dtype
    fn = conv_fn if function_for is None else function_for(dtype)
    return getattr(fn, "look_back", None)


def look_back_state(kernels, idx: ConvIndex, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Every segment's look-back in the kernels' state layout (see `LookBackConv`)."""
    a, b = idx.state_gather(weight.shape[-1], x.shape[-1], kernels.layout)
    if kernels.layout == "x":
        return a
    return torch.where(b, x.reshape(-1).index_select(0, a.reshape(-1)).view(a.shape), 0)


class LookBackConv(torch.autograd.Function):
    """The conv over the compact row with every segment's look-back as its initial state, one autograd node.

    `kernels.forward(x, weight, bias, state, idx, activation) -> y` and
    `kernels.backward(x, weight, bias, state, dy, idx, activation) -> (dx, dweight, dbias, dstate)`:
    layout "fla" / "rows": the state gathered here (one gather, rows a segment lacks set to zero), its
    gradient added into the parent rows of dx (one index_add_); "x": `state` is the `[S, W]` rows of x
    the kernels read themselves (nothing gathered), dstate `[S, W-1, D]` added into dx by row.
    """

    @staticmethod
    def forward(ctx, kernels, idx: ConvIndex, activation, x, weight, bias):
        state = look_back_state(kernels, idx, x, weight)
        ctx.kernels, ctx.idx, ctx.activation = kernels, idx, activation
        ctx.save_for_backward(x, weight, bias, state)
        return kernels.forward(x, weight, bias, state, idx, activation)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, state = ctx.saved_tensors
        layout = ctx.kernels.layout
        dx, dweight, dbias, dstate = ctx.kernels.backward(
            x, weight, bias, state, dy.contiguous(), ctx.idx, ctx.activation
        )
        a, b = ctx.idx.state_gather(weight.shape[-1], x.shape[-1], layout)
        # one scatter: every child's look-back gradient into its parent's rows (a root's state is zeros)
        if layout == "x":
            dx.view(-1, x.shape[-1]).index_add_(0, b, dstate.reshape(-1, x.shape[-1]))
        else:
            dx.reshape(-1).index_add_(0, a.reshape(-1), torch.where(b, dstate, 0).reshape(-1))
        return None, None, None, dx, dweight, dbias


def shared_prefix_causal_conv1d(
    plan, conv_fn, x, weight, bias=None, activation: str | None = "silu"
) -> torch.Tensor:
    """Varlen causal conv1d over the compact row in one `conv_fn` call (the `causal_conv1d` slot).

    `x: [1, C, D]`, `weight: [D, W]` with `W` at most the plan's `conv_kernel_size`; returns `[1, C, D]`.
    """
    idx: ConvIndex = plan.conv
    if weight.shape[-1] > idx.kernel_size:
        raise ValueError(
            f"conv kernel width {weight.shape[-1]} exceeds the plan's conv_kernel_size={idx.kernel_size}: "
            f"build the plan with conv_kernel_size={weight.shape[-1]}"
        )
    kernels = look_back_kernels(conv_fn, x.dtype)
    if idx.extra_src is not None:
        # padded plan: the state path over the compact row and the extra padding rows, which only padding
        # segments read (their outputs are dropped, their gradient is zero)
        if kernels is None or weight.shape[-1] < 2:
            raise CudaGraphsUnavailable(
                "shared_prefix_cuda_graphs pads the plan to bucket counts, which needs a causal_conv1d backend with "
                f"state kernels (fla, triton, torch) and a conv of width >= 2; got width {weight.shape[-1]} on "
                f"{getattr(conv_fn, '__module__', conv_fn)}. Choose one of those backends, or set "
                "shared_prefix_cuda_graphs_buckets=False (graphs then key on the exact layout)"
            )
        rows = x.shape[1]
        x_all = torch.cat([x, x.index_select(1, idx.extra_src)], dim=1)
        return LookBackConv.apply(kernels, idx, activation, x_all, weight, bias)[:, :rows]
    if call_graphs.LAYER_GRAPHS.capturing and not (getattr(kernels, "plan_tables", False) and weight.shape[-1] > 1):
        fn = getattr(conv_fn, "function_for", lambda dtype: conv_fn)(x.dtype)
        raise CudaGraphsUnavailable(derived_tables_refused("causal_conv1d", fn))
    if kernels is not None and weight.shape[-1] > 1:
        x = x.contiguous()
        inputs = (x, weight) if bias is None else (x, weight, bias)
        # a scoring forward on CUDA replays one graph of the conv per forward (`call_graphs.py`)
        if CALL_GRAPHS.applies(kernels, inputs):

            def conv(x, weight, bias=None):
                return kernels.forward(x, weight, bias, look_back_state(kernels, idx, x, weight), idx, activation)

            y = CALL_GRAPHS.run("causal_conv1d", idx, (kernels, activation), conv, inputs)
            if y is not None:
                return y
        return LookBackConv.apply(kernels, idx, activation, x, weight, bias)
    y = conv_fn(x.index_select(1, idx.src), weight, bias, activation=activation, cu_seqlens=idx.cu_seqlens)
    return y.index_select(1, idx.out_index)
