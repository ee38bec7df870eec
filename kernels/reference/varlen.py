"""Sequence boundaries of a packed row, shared by the references."""

from __future__ import annotations

import itertools

import torch


def sequence_bounds(
    cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None, total: int
) -> list[int]:
    """Boundaries ``[0, ..., total]`` as Python ints; reads ``cu_seqlens_cpu`` first to avoid a device sync."""
    source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    if source is None:
        return [0, total]
    bounds = [int(b) for b in source.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must rise from 0 to the row length {total}, got {bounds}")
    return bounds


def positions_in_sequence(cu_seqlens: torch.Tensor | None, total: int, device: torch.device) -> torch.Tensor:
    """Each token's offset from the start of its sequence, computed on the device (no host sync)."""
    index = torch.arange(total, device=device)
    if cu_seqlens is None:
        return index
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    owner = torch.searchsorted(starts, index, right=True) - 1
    return index - starts[owner]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32, float64 for float64: the references' accumulation type."""
    return torch.promote_types(dtype, torch.float32)
