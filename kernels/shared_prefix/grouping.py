"""Which sequences share a prefix: bucketing, lexicographic runs and the tokens-saved dynamic program.

Pure host code over numpy arrays; it never touches a device. Two sequences share a prefix only
where their token ids and every position row agree, since RoPE (and M-RoPE) makes a row's hidden
state depend on its position.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

BUCKET_TOKENS = 64  # sequences are bucketed by their first 64 token ids


@dataclass(frozen=True)
class Group:
    """Sequences that share their first `prefix_length` tokens; `members` are packed sequence indices, ascending."""

    members: tuple[int, ...]
    prefix_length: int


def find_groups(
    ids: np.ndarray, positions: np.ndarray | None, cu: list[int], min_prefix: int = 64, runs=None
) -> list[Group]:
    """Groups of sequences with a common prefix of at least `min_prefix` tokens, in packed order.

    `ids` is `[T]`, `positions` `[R, T]` (every position row) or None for per-sequence positions,
    which agree wherever offsets agree; `cu` the sequence boundaries. Every member keeps at least
    one suffix token. Sequences in no group are not listed. `runs`: `sorted_runs` of the same
    arguments, when the caller has them already.
    """
    groups: list[Group] = []
    for order, adjacent in sorted_runs(ids, positions, cu, min_prefix) if runs is None else runs:
        for lo, hi, prefix in _best_partition(adjacent, min_prefix):
            groups.append(Group(tuple(sorted(order[lo:hi])), prefix))
    groups.sort(key=lambda grp: grp.members[0])
    return groups


def sorted_runs(
    ids: np.ndarray, positions: np.ndarray | None, cu: list[int], min_prefix: int
) -> list[tuple[list[int], list[int]]]:
    """Per bucket of two or more candidates: its sequences in lexicographic order, and the capped
    common prefix of each adjacent pair (in that order, the common prefix of a contiguous run is
    the minimum over its adjacent pairs, so the best groups are contiguous runs)."""
    # one symbol per row: the id, then every position row, viewed as one opaque element so that
    # rows compare in one vectorised test
    symbols = ids if positions is None else _rows_as_elements(np.stack([ids, *positions], axis=1))
    key_len = min(BUCKET_TOKENS, min_prefix)
    buckets: dict[bytes, list[int]] = {}
    for s in range(len(cu) - 1):
        start, end = cu[s], cu[s + 1]
        # prefix <= length - 1 and prefix >= min_prefix, so shorter sequences can never share
        if end - start > min_prefix:
            key = ids[start : start + key_len].tobytes()
            buckets.setdefault(key, []).append(s)
    runs = []
    for members in buckets.values():
        if len(members) < 2:
            continue
        blocks = [symbols[cu[s] : cu[s + 1]] for s in members]
        # raw bytes of the row-major blocks give one lexicographic order
        order = sorted(range(len(members)), key=lambda i: blocks[i].tobytes())
        adjacent = [_common_prefix(blocks[a], blocks[b]) for a, b in itertools.pairwise(order)]
        runs.append(([members[i] for i in order], adjacent))
    return runs


def _rows_as_elements(rows: np.ndarray) -> np.ndarray:
    """`[T, k]` int64 rows as `[T]` opaque elements that compare equal exactly when the rows do."""
    rows = np.ascontiguousarray(rows)
    return rows.view(np.dtype((np.void, rows.itemsize * rows.shape[1]))).reshape(-1)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Leading symbols that match, capped so both sequences keep a suffix token."""
    n = min(len(a), len(b))
    if n == 0:
        return -1
    differs = a[:n] != b[:n]
    first = int(differs.argmax())
    if not differs[first]:
        first = n
    return min(first, n - 1)


def _best_partition(adjacent: list[int], min_prefix: int) -> list[tuple[int, int, int]]:
    """Split a sorted run into contiguous groups maximising tokens saved, `sum (m - 1) * p` with `p >= min_prefix`.

    `adjacent[i]` is the capped common prefix of sorted items `i` and `i + 1`. Returns
    `(lo, hi, prefix)` for every group of two or more; items outside them stay singletons.
    """
    m = len(adjacent) + 1
    best = [0] * (m + 1)  # best[j]: most tokens saved by items [0, j)
    choice: list[tuple[int, int]] = [(0, 0)] * (m + 1)  # (start of the last segment, its prefix)
    for j in range(1, m + 1):
        best[j], choice[j] = best[j - 1], (j - 1, 0)  # item j-1 alone
        prefix = None
        for i in range(j - 2, -1, -1):  # last segment [i, j) of two or more items
            prefix = adjacent[i] if prefix is None else min(prefix, adjacent[i])
            if prefix < min_prefix:
                break  # the running minimum only shrinks
            saved = best[i] + (j - i - 1) * prefix
            if saved > best[j]:
                best[j], choice[j] = saved, (i, prefix)
    segments = []
    j = m
    while j > 0:
        i, prefix = choice[j]
        if j - i > 1:
            segments.append((i, j, prefix))
        j = i
    return segments[::-1]
