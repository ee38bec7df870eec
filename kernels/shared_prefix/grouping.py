"""Which sequences share a prefix: bucketing, lexicographic runs and the tokens-saved dynamic program.

Pure host code over numpy arrays; it never touches a device. Two sequences share a prefix only
where their token ids and every position row agree, since RoPE (and M-RoPE) makes a row's hidden
state depend on its position.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .rows import counting, ranges

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
        lowest = min(adjacent)
        if lowest == max(adjacent):  # one common prefix (a plain GRPO group): all together or none
            if lowest >= min_prefix:
                groups.append(Group(tuple(sorted(order)), lowest))
            continue
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
    cu_arr = np.asarray(cu, dtype=np.int64)
    # prefix <= length - 1 and prefix >= min_prefix, so shorter sequences can never share
    candidates = np.flatnonzero(np.diff(cu_arr) > min_prefix)
    if len(candidates) < 2:
        return []
    key_len = min(BUCKET_TOKENS, min_prefix)
    # one symbol per row: the id, then every position row; the raw bytes of a sequence's
    # row-major block give one lexicographic order
    if positions is None:
        orders = _sorted_buckets(ids, cu_arr, candidates, key_len)
    else:
        symbols = np.stack([ids, *positions], axis=1)
        buckets = _buckets(ids, cu_arr, candidates, key_len)
        orders = [sorted(seqs, key=lambda s: symbols[cu[s] : cu[s + 1]].tobytes()) for seqs in buckets]
    if not orders:
        return []
    flat = np.fromiter(itertools.chain.from_iterable(orders), np.int64)
    last = np.cumsum([len(o) for o in orders]) - 1  # each bucket's last sequence pairs with nothing
    pairs = np.ones(len(flat), dtype=bool)
    pairs[last] = False
    first, second = flat[pairs], flat[1:][pairs[:-1]]
    # members of a bucket agree on their first key_len ids: without position rows there is
    # nothing to compare there
    skip = key_len if positions is None else 0
    adjacent = _common_prefixes(ids, positions, cu_arr, first, second, skip).tolist()
    runs, at = [], 0
    for order in orders:
        runs.append((order, adjacent[at : at + len(order) - 1]))
        at += len(order) - 1
    return runs


def _sorted_buckets(ids: np.ndarray, cu: np.ndarray, candidates: np.ndarray, key_len: int) -> list[list[int]]:
    """Buckets of `_buckets`, each in lexicographic order, when a sequence's symbols are its ids:
    one sort of every candidate by its bytes, whose runs of equal first `key_len` ids are the
    buckets (the bucket key is a prefix of the sort key)."""
    bounds = cu.tolist()
    order = sorted(candidates.tolist(), key=lambda s: ids[bounds[s] : bounds[s + 1]].tobytes())
    starts = cu[order]
    heads = ids[starts[:, None] + counting(key_len)]
    edges = np.flatnonzero((heads[1:] != heads[:-1]).any(axis=1)) + 1
    bounds = [0, *edges.tolist(), len(order)]
    buckets = [order[a:b] for a, b in itertools.pairwise(bounds) if b - a >= 2]
    return sorted(buckets, key=min)


_HASH = np.random.default_rng(19).integers(1, 2**62, BUCKET_TOKENS, dtype=np.int64) | 1


def _buckets(ids: np.ndarray, cu: np.ndarray, candidates: np.ndarray, key_len: int) -> list[list[int]]:
    """Candidates with the same first `key_len` ids, two or more per bucket; buckets in packed order
    of their first member, members ascending. A hash of the heads finds the buckets, an exact
    compare of every head with its bucket's first confirms them (a collision falls back to an
    exact unique over the heads)."""
    heads = ids[cu[candidates, None] + np.arange(key_len, dtype=np.int64)]
    with np.errstate(over="ignore"):
        hashes = (heads * _HASH[:key_len]).sum(axis=1)  # wraps modulo 2**64
    _, first, bucket, counts = np.unique(hashes, return_index=True, return_inverse=True, return_counts=True)
    bucket = bucket.reshape(-1)
    if not np.array_equal(heads, heads[first[bucket]]):
        rows = np.ascontiguousarray(heads).view(np.dtype((np.void, heads.itemsize * key_len))).reshape(-1)
        _, bucket, counts = np.unique(rows, return_inverse=True, return_counts=True)
        bucket = bucket.reshape(-1)
    keep = counts[bucket] >= 2
    candidates, bucket = candidates[keep], bucket[keep]
    if not len(candidates):
        return []
    by_bucket = np.argsort(bucket, kind="stable")
    edges = [0, *(np.flatnonzero(np.diff(bucket[by_bucket])) + 1).tolist(), len(candidates)]
    members = candidates[by_bucket].tolist()
    return sorted((members[a:b] for a, b in itertools.pairwise(edges)), key=lambda m: m[0])


PAIRWISE_MAX = 128  # up to this many pairs, one slice compare each beats building the side-by-side rows


def _common_prefixes(
    ids, positions, cu: np.ndarray, first: np.ndarray, second: np.ndarray, skip: int = 0
) -> np.ndarray:
    """Leading symbols that match for every pair `(first[i], second[i])` of sequences, capped so both
    keep a suffix token; the first `skip` symbols of every pair are known to match (both sequences
    are longer than `skip`). Few pairs: one slice compare each; many (short sequences): the
    overlapping rows of all pairs side by side, compared in one pass."""
    n = np.minimum(cu[first + 1] - cu[first], cu[second + 1] - cu[second])
    rest = n - skip
    if len(first) <= PAIRWISE_MAX:
        out = []
        for a, b, k in zip((cu[first] + skip).tolist(), (cu[second] + skip).tolist(), rest.tolist()):
            differs = ids[a : a + k] != ids[b : b + k]
            if positions is not None:
                differs |= (positions[:, a : a + k] != positions[:, b : b + k]).any(axis=0)
            at = int(differs.argmax())
            out.append(at if differs[at] else k)
        return np.minimum(skip + np.asarray(out, dtype=np.int64), n - 1)
    left, right = ranges(cu[first] + skip, rest), ranges(cu[second] + skip, rest)
    differs = ids[left] != ids[right]
    if positions is not None:
        differs |= (positions[:, left] != positions[:, right]).any(axis=0)
    pair_start = np.cumsum(rest) - rest
    hits = np.flatnonzero(differs)
    if not len(hits):
        return n - 1
    after = np.searchsorted(hits, pair_start)  # the first differing row at or after each pair's start
    first_hit = np.where(after < len(hits), hits[np.minimum(after, len(hits) - 1)] - pair_start, rest)
    return np.minimum(skip + np.minimum(first_hit, rest), n - 1)


def _best_partition(adjacent: list[int], min_prefix: int) -> list[tuple[int, int, int]]:
    """Split a sorted run into contiguous groups maximising tokens saved, `sum (m - 1) * p` with `p >= min_prefix`.

    `adjacent[i]` is the capped common prefix of sorted items `i` and `i + 1`. Returns
    `(lo, hi, prefix)` for every group of two or more; items outside them stay singletons.

    `best[j] = max(best[j - 1], max_i best[i] + (j - 1 - i) * min(adjacent[i : j - 1]))`. For a
    given `j` the minimum is a step function of `i`, kept as a stack of blocks of equal minimum `v`
    (rising towards `j`); a block only needs `max_i best[i] - i * v`, which is recomputed only when
    a new adjacent value lowers its `v`. That is O(m * levels of the trie), not O(m^2), on a run
    where every pair shares a long system prompt. Ties resolve as a scan from `i = j - 2` down
    would: the item alone first, then the largest `i`.
    """
    m = len(adjacent) + 1
    best = [0] * (m + 1)  # best[j]: most tokens saved by items [0, j)
    choice: list[tuple[int, int]] = [(0, 0)] * (m + 1)  # (start of the last segment, its prefix)
    stack: list[list[int]] = []  # blocks [lo, hi, v, top, at]: top = best[at] - at * v, the max over [lo, hi]
    for j in range(1, m + 1):
        best[j], choice[j] = best[j - 1], (j - 1, 0)  # item j-1 alone
        if j < 2:
            continue
        i = j - 2
        v = adjacent[i]
        if v < min_prefix:
            stack.clear()  # no segment reaches back across this pair any more
            continue
        top, at, lo = best[i] - i * v, i, i
        while stack and stack[-1][2] >= v:
            b_lo, b_hi, b_v, b_top, b_at = stack.pop()
            if b_v != v:  # its minimum drops to v: rescan the block
                b_top, b_at = best[b_hi] - b_hi * v, b_hi
                for k in range(b_hi - 1, b_lo - 1, -1):
                    val = best[k] - k * v
                    if val > b_top:
                        b_top, b_at = val, k
            if b_top > top:  # the block lies below i: it wins only when strictly better
                top, at = b_top, b_at
            lo = b_lo
        stack.append([lo, i, v, top, at])
        for _, _, b_v, b_top, b_at in reversed(stack):  # nearest block first
            saved = b_top + (j - 1) * b_v
            if saved > best[j]:
                best[j], choice[j] = saved, (b_at, b_v)
    segments = []
    j = m
    while j > 0:
        i, prefix = choice[j]
        if j - i > 1:
            segments.append((i, j, prefix))
        j = i
    return segments[::-1]
