"""Index arithmetic on runs of rows, shared by the grouping and every index builder (host, numpy)."""

from __future__ import annotations

import numpy as np


def ranges(starts, lengths) -> np.ndarray:
    """Concatenation of `arange(s, s + n)` for every `(s, n)`, without a Python loop over rows."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    out = np.repeat(starts - offsets, lengths)
    out += counting(len(out))
    return out


_COUNTING = np.zeros(0, dtype=np.int64)


def counting(n: int) -> np.ndarray:
    """`arange(n)` as a read-only view of one cached array, grown as needed.

    Plan building is bound by fresh memory more than by arithmetic (on a busy host a new 64k-row
    temporary costs more in page faults than the adds that use it), so this one is kept.
    """
    global _COUNTING
    if len(_COUNTING) < n:
        grown = np.arange(max(n, 2 * len(_COUNTING)), dtype=np.int64)
        grown.flags.writeable = False
        _COUNTING = grown
    return _COUNTING[:n]


def boundaries(lengths) -> np.ndarray:
    """cu_seqlens of consecutive segments with these lengths."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out
