"""Per-sequence positions of a packed row, and what position rows a plan may ignore when grouping."""

from __future__ import annotations

import numpy as np
import torch

from .rows import counting


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """`[1, length]` int64 positions restarting at 0 at every sequence start (rows past the last boundary count on
    from it); on the device, no sync."""
    if cu_seqlens.device.type == "cpu":
        # numpy's one-thread search: torch's CPU `searchsorted` over a row took the H200's 16-core host 0.4-1.3 ms
        # a plan (its thread pool), numpy tens of us (bench/host_split.py, fourteenth session)
        bounds = cu_seqlens.numpy().astype(np.int64, copy=False)
        t = np.arange(length, dtype=np.int64)
        seq = np.searchsorted(bounds[1:], t, side="right")
        return torch.from_numpy(t - bounds[seq]).unsqueeze(0)
    return _searched_on_device(cu_seqlens, length)


def _searched_on_device(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(length, device=cu.device)
    seq = torch.searchsorted(cu[1:].contiguous(), t, right=True)
    return (t - cu.index_select(0, seq)).unsqueeze(0)


FEW_SEQUENCES = 32  # up to this many sequences, a slice compare each beats one gather of the whole row


def offset_rows(pos: np.ndarray, cu) -> str | None:
    """How host positions `[R, T]` depend on the offset inside each sequence: "per_sequence" (every
    row is the offset: 0, 1, 2, ... from every sequence start), "offset" (every row holds the same
    value at the same offset in every sequence, some other function of the offset), else None.

    In both cases two sequences' positions agree at every offset they both have, so the ids alone
    decide which rows are shared. Rows that fail mostly do so at a sequence's first or last row,
    looked at first; then each distinct row is compared with the offsets, or with itself gathered
    at the longest sequence (which holds every offset).
    """
    bounds = np.asarray(cu, dtype=np.int64)
    lengths = bounds[1:] - bounds[:-1]
    t = int(bounds[-1])
    if t == 0:
        return "per_sequence"
    ref = int(lengths.argmax())
    ref_start = int(bounds[ref])
    full = lengths > 0
    firsts, lasts = bounds[:-1][full], bounds[1:][full] - 1
    ref_lasts = ref_start + lengths[full] - 1
    # every row at every sequence's first and last row, against the longest sequence's (all rows at once)
    if not (pos[:, firsts] == pos[:, ref_start, None]).all() or not np.array_equal(pos[:, lasts], pos[:, ref_lasts]):
        return None
    distinct: list[np.ndarray] = []
    for row in pos:
        if not any(_same_bytes(row, kept) for kept in distinct):
            distinct.append(row)
    if len(lengths) <= FEW_SEQUENCES:  # few (long) sequences: each compared as a slice, nothing gathered
        per_sequence = True
        for row in distinct:
            ref_row = row[ref_start:]
            for a, n in zip(bounds[:-1][full].tolist(), lengths[full].tolist()):
                if not (row[a : a + n] == ref_row[:n]).all():  # ref_row holds every offset: as long
                    return None
            per_sequence = per_sequence and np.array_equal(ref_row[: lengths[ref]], counting(int(lengths[ref])))
        return "per_sequence" if per_sequence else "offset"
    offsets = np.repeat(-bounds[:-1], lengths)
    offsets += counting(t)
    per_sequence, seen, checked = True, None, None
    for row in distinct:
        if _same_bytes(row, offsets):
            checked = offsets
            continue
        per_sequence = False
        if seen is None:
            seen = np.empty(t, dtype=row.dtype)
        # a row that differs from one already checked by a constant is one too
        if checked is not None and _constant_difference(row, checked, seen):
            continue
        np.take(row[ref_start:], offsets, out=seen, mode="clip")  # offsets lie inside the longest sequence
        if not np.array_equal(seen, row):
            return None
        checked = row
    return "per_sequence" if per_sequence else "offset"


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal arrays; rows that differ mostly do so early, so a look at the heads spares most full compares."""
    return np.array_equal(a[:256], b[:256]) and np.array_equal(a, b)


def _constant_difference(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """`a - b` (wrapping as int64 does) is one value throughout; `out`: room for it. Rows that are not
    mostly differ early, so the heads are compared first and spare the full pass."""
    head = min(len(a), 256)
    np.subtract(a[:head], b[:head], out=out[:head])
    step = out[0]
    if not (out[:head] == step).all():
        return False
    np.subtract(a, b, out=out)
    return bool((out == step).all())
