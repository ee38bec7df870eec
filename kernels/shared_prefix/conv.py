"""Causal depthwise conv1d on the compact row: look-back rows in front of every segment, dropped after.

One varlen call, whatever the depth of the prefix tree: a root or singleton whole, every other
segment (nested node or leaf) as `[last W-1 rows of its parent | its rows]`. A row's output then
reads exactly the rows it reads when packed (a nested node is at least W-1 rows long).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout import Layout
from .rows import Arena


@dataclass(frozen=True, eq=False)
class ConvIndex:
    src: torch.Tensor  # [rows] compact row of each conv input row
    cu_seqlens: torch.Tensor  # [n + 1] int32
    out_index: torch.Tensor  # [C] conv output row kept for each compact row
    kernel_size: int  # the largest conv kernel the look-back serves


def conv_host_index(layout: Layout, kernel_size: int, arena: Arena | None = None) -> dict:
    """Host arrays of the one conv call, written into `arena` when given; uploaded by the plan builder."""
    arena = arena or Arena()
    segs = np.flatnonzero(layout.length > 0)
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
    seq_lengths = back + length
    kept_from = np.cumsum(seq_lengths) - seq_lengths + back  # conv output row of each segment's first row
    starts = np.stack([parent_end - back, layout.start[segs]], 1).reshape(-1)
    return {
        "kernel_size": kernel_size,
        "src": arena.ranges(starts, np.stack([back, length], 1).reshape(-1)),
        "cu": arena.boundaries(seq_lengths),
        "out_index": arena.ranges(kept_from, length),  # non-empty segments tile the compact row in order
    }


def conv_index(host: dict, dev: dict) -> ConvIndex:
    return ConvIndex(dev["src"], dev["cu"], dev["out_index"], host["kernel_size"])


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
    y = conv_fn(x.index_select(1, idx.src), weight, bias, activation=activation, cu_seqlens=idx.cu_seqlens)
    return y.index_select(1, idx.out_index)
