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
    ids: np.ndarray, positions: np.ndarray | None, cu: list[int], min_prefix: int = 64
) -> list[Group]:
    """Groups of sequences with a common prefix of at least `min_prefix` tokens, in packed order.

    `ids` is `[T]`, `positions` `[R, T]` (every position row) or None for per-sequence positions,
    which agree wherever offsets agree; `cu` the sequence boundaries. Every member keeps at least
    one suffix token. Sequences in no group are not listed.
    """
    # one symbol per row: the id, then every position row; row-major, so a sequence is one block
    symbols = ids[:, None] if positions is None else np.stack([ids, *positions], axis=1)
    key_len = min(BUCKET_TOKENS, min_prefix)
    buckets: dict[bytes, list[int]] = {}
    for s in range(len(cu) - 1):
        start, end = cu[s], cu[s + 1]
        # prefix <= length - 1 and prefix >= min_prefix, so shorter sequences can never share
        if end - start > min_prefix:
            key = ids[start : start + key_len].tobytes()
            buckets.setdefault(key, []).append(s)

    groups: list[Group] = []
    for members in buckets.values():
        if len(members) > 1:
            groups.extend(_split_bucket(symbols, cu, members, min_prefix))
    groups.sort(key=lambda grp: grp.members[0])
    return groups


def _split_bucket(symbols: np.ndarray, cu: list[int], members: list[int], min_prefix: int) -> list[Group]:
    blocks = [symbols[cu[s] : cu[s + 1]] for s in members]
    # In lexicographic order the best runs are contiguous; raw bytes of the row-major blocks give
    # one such order. The common prefix of a run is the minimum over its adjacent pairs.
    order = sorted(range(len(members)), key=lambda i: blocks[i].tobytes())
    adjacent = [_common_prefix(blocks[a], blocks[b]) for a, b in itertools.pairwise(order)]
    out = []
    for lo, hi, prefix in _best_partition(adjacent, min_prefix):
        out.append(Group(tuple(sorted(members[i] for i in order[lo:hi])), prefix))
    return out


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Leading rows where every symbol matches, capped so both sequences keep a suffix token."""
    n = min(len(a), len(b))
    differs = (a[:n] != b[:n]).any(axis=1)
    first = int(differs.argmax()) if differs.any() else n
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
