"""Causal depthwise conv1d on the compact row: look-back rows in front of every suffix, dropped after.

One varlen call over each group's prefix and, per member, `[last W-1 prefix rows | suffix_i]`
(singletons whole). A suffix row's output then reads exactly the rows it reads when packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout import GroupBlock, Layout, boundaries, ranges


@dataclass(frozen=True, eq=False)
class ConvIndex:
    src: torch.Tensor  # [rows] compact row of each conv input row
    cu_seqlens: torch.Tensor  # [n + 1] int32
    out_index: torch.Tensor  # [C] conv output row kept for each compact row
    kernel_size: int  # the largest conv kernel the look-back serves


def conv_host_index(layout: Layout, kernel_size: int) -> dict:
    out = np.empty(layout.compact_length, dtype=np.int64)
    starts, lengths, seq_lengths = [], [], []
    row = 0
    for blk in layout.blocks:
        if isinstance(blk, GroupBlock):
            p = blk.prefix_length
            starts.append(blk.prefix_start)
            lengths.append(p)
            seq_lengths.append(p)
            out[blk.prefix_start : blk.prefix_start + p] = np.arange(row, row + p)
            row += p
            back = min(kernel_size - 1, p)
            for s_start, r in zip(blk.suffix_starts, blk.suffix_lengths):
                starts += [blk.prefix_start + p - back, s_start]
                lengths += [back, r]
                seq_lengths.append(back + r)
                out[s_start : s_start + r] = np.arange(row + back, row + back + r)
                row += back + r
        elif blk.length > 0:
            starts.append(blk.start)
            lengths.append(blk.length)
            seq_lengths.append(blk.length)
            out[blk.start : blk.start + blk.length] = np.arange(row, row + blk.length)
            row += blk.length
    return {
        "kernel_size": kernel_size,
        "src": ranges(starts, lengths),
        "cu": boundaries(seq_lengths).astype(np.int32),
        "out_index": out,
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
