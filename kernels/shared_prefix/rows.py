"""Index arithmetic on runs of rows, shared by the grouping and every index builder (host, numpy)."""

from __future__ import annotations

import numpy as np


def ranges(starts, lengths) -> np.ndarray:
    """Concatenation of `arange(s, s + n)` for every `(s, n)`, without a Python loop over rows."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    # ndarray methods, not numpy's functions: their wrappers cost more than the work at a few segments
    offsets = lengths.cumsum()
    offsets -= lengths
    out = (starts - offsets).repeat(lengths)
    out += counting(len(out))
    return out


def ranges_into(out: np.ndarray, starts, lengths) -> np.ndarray:
    """`ranges(starts, lengths)` written into `out` (`sum(lengths)` values), with no temporary
    of its own size but the repeat's."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size:
        offsets = lengths.cumsum()
        offsets -= lengths
        np.add((starts - offsets).repeat(lengths), counting(len(out)), out=out)
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


def interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`[a0, b0, a1, b1, ...]` (int64): two pieces per segment, one array."""
    out = np.empty(2 * len(a), dtype=np.int64)
    out[0::2] = a
    out[1::2] = b
    return out


def boundaries(lengths) -> np.ndarray:
    """cu_seqlens of consecutive segments with these lengths."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.asarray(lengths, dtype=np.int64).cumsum(out=out[1:])
    return out


class Arena:
    """One int64 buffer that a plan's index arrays are written into, as typed views.

    Building then touches fresh memory once (a busy host pays page faults for every new 64k-row
    array, more than the arithmetic that fills it), and the upload is one copy of the used slots.
    An array that does not fit, or an arena without a buffer, gets ordinary memory instead; the
    upload packs such arrays itself. An int32 array takes whole 8-byte slots, so views stay aligned.
    """

    def __init__(self, buffer: np.ndarray | None = None, owner=None):
        self.buffer = buffer
        self.owner = owner  # the tensor whose memory `buffer` is, if any (the upload copies from it)
        self.used = 0  # slots handed out
        self._address = None if buffer is None else buffer.ctypes.data

    def take(self, n: int, dtype=np.int64) -> np.ndarray:
        """Room for `n` values of `dtype` (uninitialised)."""
        dtype = np.dtype(dtype)
        slots = -(-n * dtype.itemsize // 8)
        if self.buffer is None or self.used + slots > len(self.buffer):
            return np.empty(n, dtype=dtype)
        view = self.buffer[self.used : self.used + slots].view(dtype)[:n]
        self.used += slots
        return view

    def put(self, values, dtype=np.int64) -> np.ndarray:
        """A copy of `values` (any shape) in the arena."""
        values = np.asarray(values)
        out = self.take(values.size, dtype).reshape(values.shape)
        out[...] = values
        return out

    def ranges(self, starts, lengths) -> np.ndarray:
        """`ranges(starts, lengths)` written into the arena."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if not len(lengths):
            return self.take(0)
        offsets = lengths.cumsum()  # one pass gives the total and each run's first slot
        out = self.take(int(offsets[-1]))
        offsets -= lengths
        np.add((np.asarray(starts, dtype=np.int64) - offsets).repeat(lengths), counting(len(out)), out=out)
        return out

    def boundaries(self, lengths, dtype=np.int32) -> np.ndarray:
        """`boundaries(lengths)` written into the arena (int32, the varlen kernels' dtype)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        out = self.take(len(lengths) + 1, dtype)
        out[0] = 0
        lengths.cumsum(out=out[1:])  # int32 boundaries of int64 lengths: they are row counts
        return out

    def slot_of(self, array: np.ndarray) -> int | None:
        """First slot of a contiguous view into the buffer, or None when the array lives elsewhere."""
        if self.buffer is None or not array.flags.c_contiguous:
            return None
        at = array.ctypes.data - self._address
        if at < 0 or at % 8 or at + array.nbytes > self.used * 8:
            return None
        return at // 8
