"""Which sequences share a prefix: bucketing, lexicographic runs and the tokens-saved dynamic program.

Pure host code over numpy arrays; it never touches a device. Two sequences share a prefix only
where their token ids and every position row agree, since RoPE (and M-RoPE) makes a row's hidden
state depend on its position.

Position rows take the cheapest of three paths, all giving the runs of comparing every row:
rows that count up from a constant of each sequence (a VL model's M-RoPE rows of text, a global
arange) agree at every offset exactly where the constants do, so the ids decide the rest; other
rows are packed into one int64 per row before the compare; rows too wide to pack are compared
one by one. Per-sequence positions are the first kind with one constant for all: the ids alone.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np

from .rows import Arena

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
    runs = sorted_runs(ids, positions, cu, min_prefix) if runs is None else runs
    return [Group(members, prefix) for members, prefix in group_runs(runs, min_prefix)[0]]


def group_runs(runs, min_prefix: int) -> tuple[list[tuple[tuple[int, ...], int]], bool]:
    """`(members, prefix)` of every group of `find_groups`, in packed order, from the runs of
    `sorted_runs`; and whether some run nests (its adjacent prefixes are not all one value)."""
    groups, nests = [], False
    for order, adjacent in runs:
        lowest = min(adjacent)
        if lowest == max(adjacent):  # one common prefix (a plain GRPO group): all together or none
            if lowest >= min_prefix:
                groups.append((tuple(sorted(order)), lowest))
            continue
        nests = True
        for lo, hi, prefix in _best_partition(adjacent, min_prefix):
            groups.append((tuple(sorted(order[lo:hi])), prefix))
    groups.sort(key=_first_member)
    return groups, nests


def _first_member(group: tuple[tuple[int, ...], int]) -> int:
    return group[0][0]


def sorted_runs(
    ids: np.ndarray, positions: np.ndarray | None, cu: list[int], min_prefix: int
) -> list[tuple[list[int], list[int]]]:
    """Per bucket of two or more candidates: its sequences in lexicographic order, and the capped
    common prefix of each adjacent pair (in that order, the common prefix of a contiguous run is
    the minimum over its adjacent pairs, so the best groups are contiguous runs)."""
    cu_arr = np.asarray(cu, dtype=np.int64)
    # prefix <= length - 1 and prefix >= min_prefix, so shorter sequences can never share
    candidates = ((cu_arr[1:] - cu_arr[:-1]) > min_prefix).nonzero()[0]
    if len(candidates) < 2:
        return []
    key_len = min(BUCKET_TOKENS, min_prefix)
    # room for the largest path: offsets (1 row + mask), symbols (1 + R rows), packed (2 rows), and
    # the batched compare (4 rows + mask)
    scratch = Arena(_scratch((12 + (0 if positions is None else len(positions))) * len(ids)))
    offsets = None
    every_row = positions  # with rows equal to others: one slice compare of all of them per pair
    if positions is not None:
        offsets = sequence_offsets(positions, cu_arr, scratch)
        if offsets is None:
            positions = _distinct_rows(positions)
        elif (offsets[candidates] == offsets[candidates[0]]).all():
            positions = offsets = None  # one constant for all: positions agree wherever offsets do
    # one symbol per row: the id, then every position row; the raw bytes of a sequence's
    # row-major block give one lexicographic order
    if positions is None:
        order, same = _sorted_order(ids, cu_arr, candidates, key_len)
        # members of a bucket agree on their first key_len ids: nothing to compare there
        first, second = order[:-1][same], order[1:][same]
        return _runs_of_order(order, same, _common_prefixes(ids, None, cu_arr, first, second, key_len, scratch))
    elif offsets is not None:
        # Rows that count up from a constant of each sequence: at every offset two sequences'
        # positions agree exactly when their constants do. The ids of a bucket agree on row 0,
        # so its symbols compare as the constants (bytes of row 0's positions), then as the ids.
        constants = [row.tobytes() for row in offsets]
        buckets = _buckets(ids, cu_arr, candidates, key_len)
        own = _sequence_bytes(ids, cu_arr, itertools.chain.from_iterable(buckets))
        orders = [sorted(seqs, key=lambda s: (constants[s], own[s])) for seqs in buckets]
    else:
        runs = _runs_in_id_order(ids, positions, np.asarray(every_row), cu_arr, candidates, key_len, scratch)
        if runs is not None:
            return runs
        symbols = scratch.take(len(ids) * (1 + len(positions))).reshape(len(ids), -1)
        np.stack([ids, *positions], axis=1, out=symbols)
        buckets = _buckets(ids, cu_arr, candidates, key_len)
        orders = [sorted(seqs, key=lambda s: symbols[cu[s] : cu[s + 1]].tobytes()) for seqs in buckets]
    if not orders:
        return []
    first, second = _adjacent_pairs(orders)
    if offsets is not None:
        # different constants differ on row 0; equal ones leave the ids to compare
        same = (offsets[first] == offsets[second]).all(axis=1)
        adjacent = np.zeros(len(first), dtype=np.int64)
        adjacent[same] = _common_prefixes(ids, None, cu_arr, first[same], second[same], key_len, scratch=scratch)
    else:
        # one packed row pays off when every row of every pair is compared at once; a few pairs
        # compare their own slices, row by row
        packed = row_symbols(ids, positions, scratch) if len(first) > PAIRWISE_MAX else None
        if packed is None:
            adjacent = _common_prefixes(ids, positions, cu_arr, first, second, scratch=scratch)
        else:
            adjacent = _common_prefixes(packed, None, cu_arr, first, second, scratch=scratch)
    return _split_runs(orders, adjacent)


def _split_runs(orders: list[list[int]], adjacent: np.ndarray) -> list[tuple[list[int], list[int]]]:
    """The runs of `sorted_runs` from the buckets' orders and every adjacent pair's prefix, bucket after bucket."""
    adjacent = adjacent.tolist()
    runs, at = [], 0
    for order in orders:
        runs.append((order, adjacent[at : at + len(order) - 1]))
        at += len(order) - 1
    return runs


def _adjacent_pairs(orders: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """`(first, second)`: every pair of neighbours inside a bucket's order, bucket after bucket."""
    flat = np.fromiter(itertools.chain.from_iterable(orders), np.int64)
    last = np.cumsum([len(o) for o in orders]) - 1  # each bucket's last sequence pairs with nothing
    pairs = np.ones(len(flat), dtype=bool)
    pairs[last] = False
    return flat[pairs], flat[1:][pairs[:-1]]


def _runs_in_id_order(
    ids: np.ndarray,
    positions: list[np.ndarray],
    every_row: np.ndarray,
    cu: np.ndarray,
    candidates: np.ndarray,
    key_len: int,
    scratch: Arena,
) -> list[tuple[list[int], list[int]]] | None:
    """`sorted_runs` for position rows that do not count up, when sorting by the ids alone gives the
    symbol order (else None): the usual case, where sequences that agree on their ids up to a row
    agree on their positions there too (positions follow the content: M-RoPE rows of the same
    image grid).

    The symbol order compares two sequences at their first differing symbol, id first. When that
    row's ids differ, the ids' own order decides them the same way; when the pair agrees on every
    row both hold, both orders put the shorter first (equal sequences: ascending index, as the
    stable sorts do). Being sorted is a property of adjacent pairs, so checking every adjacent pair
    of the id order checks the whole order. Building and byte-sorting the `[T, 1 + R]` symbols is
    what this spares. `positions` are the distinct rows, `every_row` all of them `[R, T]` (a few
    pairs compare all rows in one slice each: fewer calls weigh more than a few more rows).
    """
    order, same = _sorted_order(ids, cu, candidates, key_len)
    first, second = order[:-1][same], order[1:][same]
    n = np.minimum(cu[first + 1] - cu[first], cu[second + 1] - cu[second])
    # members of a bucket agree on their first key_len ids: nothing to compare there
    differ_at = _first_differences(ids, None, cu, first, second, key_len, scratch=scratch)
    # the first differing symbol is the first differing id exactly when the positions agree on
    # every row before it (and on all rows both hold, where the ids agree throughout)
    if len(first) <= PAIRWISE_MAX:
        for a, b, k in zip(cu[first].tolist(), cu[second].tolist(), differ_at.tolist()):
            if not np.array_equal(every_row[:, a : a + k], every_row[:, b : b + k]):
                return None
    else:
        left, right = scratch.ranges(cu[first], differ_at), scratch.ranges(cu[second], differ_at)
        at_left, at_right = scratch.take(len(left)), scratch.take(len(left))
        differs = scratch.take(len(left), bool)
        for row in positions:
            np.take(row, left, out=at_left, mode="clip")  # indices built from `cu` are in range
            np.take(row, right, out=at_right, mode="clip")
            if np.not_equal(at_left, at_right, out=differs).any():
                return None  # a position differs where the ids still agree: the symbols decide that pair
    return _runs_of_order(order, same, np.minimum(differ_at, n - 1))


_SCRATCH = threading.local()
_SCRATCH_KEPT = 1 << 23  # slots (64 MiB) a thread keeps at most: a row of about 550k tokens with M-RoPE rows


def _scratch(slots: int) -> np.ndarray:
    """This thread's buffer for the grouping's temporaries, grown as needed and kept.

    Fresh memory, not arithmetic, is what a 64k-row temporary costs (a page fault per 4 KiB,
    more than the compare that fills it); the temporaries never outlive `sorted_runs`, so one
    buffer per thread serves every call (up to `_SCRATCH_KEPT` slots; longer rows get a fresh one).
    """
    if slots > _SCRATCH_KEPT:  # a row this long is rare: its buffer is not kept
        return np.empty(slots, dtype=np.int64)
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or len(buffer) < slots:
        grown = min(2 * (0 if buffer is None else len(buffer)), _SCRATCH_KEPT)
        buffer = _SCRATCH.buffer = np.empty(max(slots, grown), dtype=np.int64)
    return buffer


def _sorted_order(ids: np.ndarray, cu: np.ndarray, candidates: np.ndarray, key_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Every candidate in lexicographic order of its ids (one sort of their bytes), and for each
    adjacent pair whether both are in one bucket (the same first `key_len` ids; a bucket's key is a
    prefix of the sort key, so the buckets are runs of that order)."""
    order = candidates.tolist()
    order.sort(key=_sequence_bytes(ids, cu, order).__getitem__)
    order = np.array(order, dtype=np.int64)
    heads = _heads(ids, cu[order], key_len)
    return order, (heads[1:] == heads[:-1]).all(axis=1)


def _runs_of_order(order: np.ndarray, same: np.ndarray, adjacent: np.ndarray) -> list[tuple[list[int], list[int]]]:
    """The runs of `sorted_runs` from `_sorted_order` and the prefix of every adjacent pair in one
    bucket (in that order): per bucket of two or more its members and their pairs' prefixes,
    buckets by their smallest member."""
    bounds = [0, *((~same).nonzero()[0] + 1).tolist(), len(order)]
    members, prefixes = order.tolist(), adjacent.tolist()
    runs, at = [], 0
    for a, b in itertools.pairwise(bounds):
        if b - a >= 2:
            runs.append((members[a:b], prefixes[at : at + b - a - 1]))
            at += b - a - 1
    runs.sort(key=_smallest_member)
    return runs


def _smallest_member(run: tuple[list[int], list[int]]) -> int:
    return min(run[0])


def _heads(ids: np.ndarray, starts, key_len: int) -> np.ndarray:
    """`[n, key_len]`: the first `key_len` ids from each start (every candidate is longer), gathered as
    rows of a strided window view of the row (one copy per start, no index per id)."""
    return _windows(ids, key_len)[starts]


def _windows(row: np.ndarray, width: int) -> np.ndarray:
    """`[len(row) - width + 1, width]`: every run of `width` consecutive values, a read-only view of
    `row` (contiguous). What numpy's `sliding_window_view` gives, without its per-call checks."""
    row = np.ascontiguousarray(row)
    step = row.strides[0]
    view = np.ndarray((len(row) - width + 1, width), row.dtype, buffer=row, strides=(step, step))
    view.flags.writeable = False
    return view


def _sequence_bytes(ids: np.ndarray, cu: np.ndarray, seqs) -> dict[int, bytes]:
    """The bytes of each listed sequence's ids: a sort key per sequence, each copied once from a
    byte view of the row (no numpy slice per sequence, no copy of the whole row)."""
    view = memoryview(np.ascontiguousarray(ids)).cast("B")
    size, bounds = ids.itemsize, cu.tolist()
    return {s: view[size * bounds[s] : size * bounds[s + 1]].tobytes() for s in seqs}


_HASH = np.random.default_rng(19).integers(1, 2**62, BUCKET_TOKENS, dtype=np.int64) | 1


def _buckets(ids: np.ndarray, cu: np.ndarray, candidates: np.ndarray, key_len: int) -> list[list[int]]:
    """Candidates with the same first `key_len` ids, two or more per bucket; buckets in packed order
    of their first member, members ascending. A hash of the heads finds the buckets, an exact
    compare of every head with its bucket's first confirms them (a collision falls back to an
    exact unique over the heads)."""
    heads = _heads(ids, cu[candidates], key_len)
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


def _distinct_rows(positions: np.ndarray) -> list[np.ndarray]:
    """The position rows without those equal to an earlier row (M-RoPE rows of text tokens are all
    equal). Which rows are equal, and the byte order of the sort keys, stay the same: a dropped
    row differs between two rows only where its equal, earlier row already does."""
    kept: list[np.ndarray] = []
    for row in positions:
        # rows that differ mostly do so early: a look at the head spares most full compares
        if not any(np.array_equal(row[:256], earlier[:256]) and np.array_equal(row, earlier) for earlier in kept):
            kept.append(row)
    return kept


def sequence_offsets(positions: list[np.ndarray], cu: np.ndarray, scratch: Arena | None = None) -> np.ndarray | None:
    """`[N, R]`: the constant each position row adds to each sequence's own count (0, 1, 2, ...),
    or None when a row does not count up by one inside some sequence (0 for an empty sequence).

    Per-sequence positions are all zeros; a global arange, or M-RoPE rows of text that continue
    after earlier content, are other constants.
    """
    t = int(cu[-1])
    out = np.zeros((len(cu) - 1, len(positions)), dtype=np.int64)
    if t == 0:
        return out
    scratch = scratch or Arena()
    step, counts = scratch.take(t - 1), scratch.take(t - 1, bool)
    inner = cu[1:-1]
    inner = inner[(inner > 0) & (inner < t)] - 1  # steps that cross into the next sequence
    starts = np.minimum(cu[:-1], t - 1)
    # a row that counts up ends `length - 1` above where it starts in every sequence: checked for
    # every row first, it turns most rows that do not count up away before any full pass
    full = np.flatnonzero(np.diff(cu) > 0)
    head, tail = cu[full], cu[full + 1] - 1
    for row in positions:
        if not np.array_equal(row[tail] - row[head], tail - head):  # wraps as the steps would
            return None
    for r, row in enumerate(positions):
        np.subtract(row[1:], row[:-1], out=step)
        np.equal(step, 1, out=counts)
        counts[inner] = True
        if not counts.all():
            return None
        out[:, r] = row[starts]
    out[np.diff(cu) == 0] = 0
    return out


def row_symbols(ids: np.ndarray, positions: list[np.ndarray], scratch: Arena | None = None) -> np.ndarray | None:
    """One int64 per row, equal for two rows exactly when their id and every position row are;
    None when the values need more than 63 bits.

    Comparing one array instead of 1 + R is what keeps position rows that do not restart per
    sequence (a VL model's M-RoPE rows) as cheap as per-sequence ones. Each field is its value
    minus the field's smallest, in bits of its own (an injective packing); rows after the first
    are packed as differences from it (a bijection given the first): M-RoPE rows differ by
    little, so they take few bits.
    """
    scratch = scratch or Arena()
    out, tmp = scratch.take(len(ids)), scratch.take(len(ids))
    fields = [ids, *positions]
    lows, widths = [], []
    for r, field in enumerate(fields):
        if r >= 2:
            field = np.subtract(field, positions[0], out=tmp)
        lo, hi = int(field.min()), int(field.max())
        lows.append(lo)
        widths.append((hi - lo).bit_length())
    if sum(widths) > 63:
        return None
    out[...] = 0
    shift = 0
    for r, (field, lo, width) in enumerate(zip(fields, lows, widths)):
        if not width:  # one value throughout: tells no rows apart
            continue
        if r >= 2:
            field = np.subtract(field, positions[0], out=tmp)
        # the true difference lies in [0, 2**width): int64 wrap-around in the subtraction cannot change it
        np.subtract(field, lo, out=tmp)
        tmp <<= shift
        out |= tmp
        shift += width
    return out


PAIRWISE_MAX = 128  # up to this many pairs, one slice compare each beats building the side-by-side rows


def _common_prefixes(
    ids, positions, cu: np.ndarray, first: np.ndarray, second: np.ndarray, skip: int = 0, scratch: Arena | None = None
) -> np.ndarray:
    """Leading symbols that match for every pair `(first[i], second[i])` of sequences, capped so both
    keep a suffix token; a symbol is a row's id and its value in every row of `positions` (`[R, T]`,
    a list of rows, or None). The first `skip` symbols of every pair are known to match (both sequences
    are longer than `skip`)."""
    n = np.minimum(cu[first + 1] - cu[first], cu[second + 1] - cu[second])
    return np.minimum(_first_differences(ids, positions, cu, first, second, skip, scratch), n - 1)


def _first_differences(
    ids, positions, cu: np.ndarray, first: np.ndarray, second: np.ndarray, skip: int = 0, scratch: Arena | None = None
) -> np.ndarray:
    """The first offset where the symbols of `first[i]` and `second[i]` differ, or the shorter one's
    length where they agree throughout (arguments as for `_common_prefixes`). Few pairs: one slice
    compare each (the reference of the batched path); many (short sequences): block by block, every
    pair at once (`_first_differences_blocks`, temporaries from `scratch`)."""
    n = np.minimum(cu[first + 1] - cu[first], cu[second + 1] - cu[second])
    rest = n - skip
    if len(first) <= PAIRWISE_MAX:
        out = []
        for a, b, k in zip((cu[first] + skip).tolist(), (cu[second] + skip).tolist(), rest.tolist()):
            differs = ids[a : a + k] != ids[b : b + k]
            for row in () if positions is None else positions:
                differs |= row[a : a + k] != row[b : b + k]
            at = int(differs.argmax()) if k else 0
            out.append(at if k and differs[at] else k)
        return skip + np.asarray(out, dtype=np.int64)
    return skip + _first_differences_blocks(ids, positions, cu, first, second, skip, n, scratch or Arena())


BLOCKS = (64, 128, 256)  # rows compared per pair at a time, the last repeated: most pairs part early


def _first_differences_blocks(ids, positions, cu, first, second, skip, n, scratch: Arena) -> np.ndarray:
    """`_first_differences - skip` for many pairs at once: the next block of rows of every pair that
    still agrees, gathered as one `[pairs, width]` window of each side (a strided view of the row, no
    index per row), compared in one pass; pairs that part in a block, or run out of rows, drop out."""
    fields = [ids, *(() if positions is None else positions)]
    t, widest = len(ids), BLOCKS[-1]
    # windows read the rows in place while every window ends inside the row; the first that would
    # not (a pair near the end of the row) switches to copies with room after the end (rows past
    # the end are capped below), so a row is copied only when some pair needs it
    rows = fields if all(f.flags.c_contiguous for f in fields) else _padded(fields, t + widest, scratch)
    rest = n - skip
    out = rest.copy()
    todo = (rest > 0).nonzero()[0]
    left, right = cu[first[todo]] + skip, cu[second[todo]] + skip
    done, b = 0, 0
    while len(todo):
        width = BLOCKS[min(b, len(BLOCKS) - 1)]
        b += 1
        differs = None
        if rows is fields and max(int(left.max()), int(right.max())) + width > t:
            rows = _padded(fields, t + widest, scratch)
        for row in rows:
            windows = _windows(row, width)
            here = windows[left] != windows[right]
            differs = here if differs is None else np.logical_or(differs, here, out=differs)
        hit = differs.any(axis=1)
        parted = todo[hit]
        out[parted] = np.minimum(done + differs[hit].argmax(axis=1), rest[parted])
        done += width
        keep = ~hit & (rest[todo] > done)
        todo, left, right = todo[keep], left[keep] + width, right[keep] + width
    return out


def _padded(fields, length: int, scratch: Arena) -> list[np.ndarray]:
    """Copies of the rows, each followed by zeros up to `length`."""
    out = []
    for field in fields:
        row = scratch.take(length)
        row[: len(field)] = field
        row[len(field) :] = 0
        out.append(row)
    return out


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
    choice: list[tuple[int, int] | None] = [None] * (m + 1)  # (start of the last segment, its prefix); None: alone
    stack: list[list[int]] = []  # blocks [lo, hi, v, top, at]: top = best[at] - at * v, the max over [lo, hi]
    for i, v in enumerate(adjacent):  # pair (i, i + 1) closes items [.., i + 2)
        here, chosen = best[i + 1], None  # item i + 1 alone
        if v < min_prefix:
            stack.clear()  # no segment reaches back across this pair any more
            best[i + 2] = here
            continue
        top = best[i] - i * v
        if stack and stack[-1][2] == v:
            # the same minimum as the nearest block (a run of equal prefixes): it grows by i, no
            # rescan, and no block below it has a minimum >= v (the stack's minima rise)
            block = stack[-1]
            if not block[3] > top:  # the block lies below i: it wins only when strictly better
                block[3], block[4] = top, i
            block[1] = i
        else:
            at = lo = i
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
        last = i + 1
        for block in reversed(stack):  # nearest block first
            saved = block[3] + last * block[2]
            if saved > here:
                here, chosen = saved, (block[4], block[2])
        best[i + 2], choice[i + 2] = here, chosen
    segments = []
    j = m
    while j > 0:
        found = choice[j]
        if found is None:
            j -= 1
            continue
        i, prefix = found
        if j - i > 1:
            segments.append((i, j, prefix))
        j = i
    return segments[::-1]
