"""Per-sequence positions of a packed row, for callers that pass `position_ids=None`."""

from __future__ import annotations

import numpy as np
import torch

from .rows import counting


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """`[1, length]` int64 positions restarting at 0 at every sequence start; on the device, no sync."""
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(length, device=cu.device)
    seq = torch.searchsorted(cu[1:].contiguous(), t, right=True)
    return (t - cu.index_select(0, seq)).unsqueeze(0)


def host_positions(cu: list[int]) -> np.ndarray:
    """The same positions on the host, from a host copy of `cu_seqlens`."""
    lengths = np.diff(np.asarray(cu, dtype=np.int64))
    starts = np.repeat(np.asarray(cu[:-1], dtype=np.int64), lengths)
    return counting(cu[-1]) - starts


def are_per_sequence(pos: np.ndarray, cu: list[int]) -> bool:
    """Whether every row of host positions `[R, T]` restarts at 0 at every sequence start and counts up.

    Rows that do not restart (a VL model's M-RoPE rows, a global arange) mostly fail at a sequence
    start already, which is checked first: then no T-row reference is built.
    """
    bounds = np.asarray(cu, dtype=np.int64)
    starts = bounds[:-1][np.diff(bounds) > 0]
    if pos[:, starts].any():
        return False
    expected = host_positions(cu)
    return all(np.array_equal(row, expected) for row in pos)
