"""Padding a plan up to bucket counts, so that CUDA graphs replay across batches whose layouts differ.

A captured graph fixes every shape and host int its kernels read. In a shared-prefix step those come
from a few counts per mixer, not from the lengths one by one: the compact row's length `C`; per GDN
round its sequences, chunks of 64 and rows; the conv's segments, chunks and rows; attention's segments,
gathered keys and `max_seqlen`s. `padded_host` rounds each count up to its bucket and adds padding that no
real row reads, so two layouts of one bucket have equal shapes and host ints, and differ only in the
contents of the index tensors (copied into a graph's static buffers per step):

- the compact row gets `P = C* - C >= 1` padding rows at its end: token id of packed row 0 (any valid
  id), positions counting from 0, no LM row and no packed position (nothing scores them, nothing
  expands them: their gradient is exactly zero, and so is every contribution they make to a weight's
  gradient);
- every GDN round gets padding sequences of its own (zero initial state, final states never read),
  the conv padding segments of their own (zero look-back state), attention padding segments whose keys
  are padding rows: a sequence boundary in every mixer, so no real row reads a padding row.

Counts go up a geometric ladder (`rung`): the compact row's rows (the GEMMs', most of a step's GPU work)
by 17/16 (at most 6.25% more than needed), every other count by 9/8. Every chunk table entry is a real
chunk of a real (or padding) sequence: the tables stay what the kernels are built for. A varlen call
whose rows are free (the GDN rounds gather theirs; the conv gathers rows beyond `C*` as needed) keeps
rows and chunks both fixed:

- a GDN round fills every real sequence's last chunk with padding rows (`_fill_chunks`: the sequences
  that end mid-chunk are the ones whose final state nothing reads, so rows after their last real row
  change no real output and get no gradient). No slack is left to vary with the layout: one padding
  sequence beyond those the round's structure allows keeps rows and chunks fixed;
- the conv's segments tile the compact row and cannot be filled: one padding sequence per segment that
  may end mid-chunk absorbs up to 63 rows of that slack each.

Attention reads the compact row's queries in place and needs no chunk table.

A layout may also pad to a larger bucket than its own, one a captured graph already holds, when it
fits and costs little more (`choose_bucket`, in GPU work measured per row and per chunk: `cost`): a
replay instead of a capture. A layout that fits no held bucket captures, where it costs little more,
the merge of its own bucket with a held one (`merge`), which every layout of both fits: layouts that
fall between two held buckets, in one count or another, then replay.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from .attention import attention_keys
from .conv import look_back
from .gdn import CHUNK, RoundPieces, chunk_indices, gdn_pieces
from .rows import Arena, counting, interleave, ranges_into

RATIO = (9, 8)  # the ladder's ratio: a bucket holds at most 12.5% more than the batch needs
COMPACT_RATIO = (17, 16)  # the compact row's ladder: at most 6.25% (its rows are the GEMMs', most of a step)
# (33/32 is faster where one layout repeats; under drawn lengths it makes more own buckets, and what that costs
# is not measured yet: docs/cuda_graphs.md)


@functools.lru_cache(maxsize=4096)
def rung(x: int, ratio: tuple[int, int] | None = None) -> int:
    """The smallest ladder value >= x (ratio 9/8: 1, 2, ..., 8, 9, 11, 13, 15, 17, 20, ..., each about 9/8 of
    the last; ratio 17/16: 1, ..., 16, 17, 19, 21, ...)."""
    up, down = ratio or RATIO
    value = 1
    while value < x:
        value = max(value + 1, -(-value * up // down))
    return value


def chunks_of(lengths: np.ndarray) -> int:
    return int((-(-np.asarray(lengths, dtype=np.int64) // CHUNK)).sum())


def pad_lengths(count: int, rows: int, chunks: int) -> np.ndarray:
    """`count` sequence lengths, each >= 1, that sum to `rows` and make `chunks` chunks of 64 in all."""
    if not (1 <= count <= chunks and CHUNK * (chunks - count) + count <= rows <= CHUNK * chunks):
        raise AssertionError(f"no {count} padding sequences of {rows} rows make {chunks} chunks")
    # plain ints: a handful of sequences, where numpy calls cost more than the arithmetic
    slack = CHUNK * chunks - rows  # rows short of whole chunks, at most CHUNK - 1 per sequence
    out = [CHUNK - min(CHUNK - 1, max(0, slack - (CHUNK - 1) * i)) for i in range(count)]
    out[0] += CHUNK * (chunks - count)
    return np.array(out, dtype=np.int64)


# A varlen call whose rows are free (the GDN rounds gather theirs; the conv gathers rows past C*) is
# bucketed as (sequences N*, chunks NT*, rows R* = 64 NT* - 63 b). Its real sequences leave `slack` rows
# short of whole last chunks (0 to 63 each, varying with the layout); k = N* - n >= b padding sequences,
# each at least one chunk, absorb the remaining 63 b - slack, so rows and chunks both stay fixed for every
# layout whose slack is at most 63 b. The conv's own b is the rung of its segments (each may end anywhere),
# so every layout of the structure fits it whatever its lengths. A GDN round's sequences are filled to
# whole chunks (`_fill_chunks`): no slack, b = 0, and one padding sequence (k >= 1) serves.


@dataclass(frozen=True, eq=False)
class Lengths:
    """A varlen call's sequence lengths and the three counts the bucket rules read of them, summed once (the
    rules run for the own bucket and again for every held bucket and merge they weigh)."""

    values: np.ndarray
    count: int  # sequences
    rows: int
    chunks: int  # chunks of 64

    @classmethod
    def of(cls, values: np.ndarray) -> Lengths:
        return cls(values, len(values), int(values.sum()), chunks_of(values))

    @property
    def slack(self) -> int:
        """Rows short of whole last chunks."""
        return CHUNK * self.chunks - self.rows


def _own_free_call(lengths: Lengths, slots: int, slack_slots: int) -> tuple[int, int, int]:
    b = rung(slack_slots) if slack_slots else 0
    sequences = rung(max(slots, lengths.count)) + max(1, b)
    chunks = rung(lengths.chunks + sequences - lengths.count)
    return sequences, chunks, CHUNK * chunks - (CHUNK - 1) * b


def _fits_free(call: tuple[int, int, int], lengths: Lengths) -> bool:
    sequences, chunks, rows = call
    b = (CHUNK * chunks - rows) // (CHUNK - 1)
    k = sequences - lengths.count
    return k >= max(1, b) and chunks - lengths.chunks >= k and lengths.slack <= (CHUNK - 1) * b


def _pad_free(call: tuple[int, int, int], lengths: Lengths) -> np.ndarray:
    """The padding sequences' lengths that take a free-rows call of `lengths` to its bucket `call`."""
    sequences, chunks, rows = call
    return pad_lengths(sequences - lengths.count, rows - lengths.rows, chunks - lengths.chunks)


def _split(total: int, parts: int) -> np.ndarray:
    """`total` in `parts` near-equal parts, the larger ones first."""
    base, extra = divmod(total, parts)
    return np.array([base + 1] * extra + [base] * (parts - extra), dtype=np.int64)


def round_slots(layout) -> list[tuple[int, int]]:
    """Per GDN round, the sequences its structure allows and how many of them may end off a chunk boundary:
    round 0 every root (up to its last chunk boundary) and singleton (anywhere), round l every node of
    level l - 1 (its tail alone) and every segment of level l (the tail + child)."""
    depth = layout.depth
    level = layout.level
    segments = np.bincount(level, minlength=depth + 1).tolist()  # per level
    nodes = np.bincount(level[layout.node >= 0], minlength=depth + 1).tolist()
    slots = [(segments[0], segments[0] - nodes[0])]
    slots += [(nodes[lvl - 1] + segments[lvl],) * 2 for lvl in range(1, depth + 1)]
    return slots


def _fill_chunks(pieces: RoundPieces, rounds) -> list[np.ndarray]:
    """Per GDN round, its sequences' lengths up to whole chunks. A sequence whose final state a later round
    reads (a root up to its last chunk boundary, a nested node's segment) already ends on one; the others
    (singletons, the last round's segments, tails alone) end anywhere and nothing reads their final state,
    so rows appended after their last real row change no real output (the recurrence is causal) and get no
    gradient. Checked here: a read state of a sequence that does not end on a chunk boundary is an error."""
    for r in range(1, len(rounds)):
        state = pieces.states[r]
        if state is None or not len(rounds[r - 1]):
            continue
        if (rounds[r - 1][state[state >= 0]] % CHUNK).any():
            raise AssertionError(f"GDN round {r} reads the final state of a round {r - 1} sequence that ends mid-chunk")
    return [CHUNK * -(-lengths // CHUNK) for lengths in rounds]


@dataclass(frozen=True, eq=False)
class Needs:
    """What a layout's plan needs of a bucket: its compact length, every call's sequence lengths."""

    compact: int
    rounds: tuple[np.ndarray, ...]  # per GDN round, its sequences' lengths (empty when it has none)
    filled: tuple[Lengths, ...]  # the same, each up to its last chunk's end (`_fill_chunks`)
    slots: tuple[tuple[int, int], ...]  # per GDN round, its structure's sequences and those with slack (`round_slots`)
    conv: Lengths  # the conv's segment lengths (they tile the compact row)
    queries: np.ndarray  # attention's segment query and key lengths
    keys: np.ndarray
    max_k: int
    total_keys: int

    @classmethod
    def of(cls, layout, pieces: RoundPieces, lengths: np.ndarray, keys: np.ndarray) -> Needs:
        """From the GDN rounds' pieces and the non-empty segments' lengths and key counts (conv and
        attention run one sequence per non-empty segment)."""
        bounds = list(itertools.accumulate(pieces.counts, initial=0))
        rounds = tuple(pieces.lengths[a:b] for a, b in itertools.pairwise(bounds))
        return cls(
            compact=layout.compact_length,
            rounds=rounds,
            filled=tuple(Lengths.of(filled) for filled in _fill_chunks(pieces, rounds)),
            slots=tuple(round_slots(layout)),
            conv=Lengths.of(lengths),
            queries=lengths,
            keys=keys,
            max_k=int(keys.max()),
            total_keys=int(keys.sum()),
        )


def own_bucket(needs: Needs) -> tuple:
    """The layout's own bucket: every count rounded up the ladder (see the module docstring)."""
    s = len(needs.queries)
    s_star = rung(s + 1)  # at least one padding attention segment
    c_star = rung(needs.compact + s_star - s, COMPACT_RATIO)  # a padding row (at least) per padding segment
    # every real GDN sequence fills whole chunks: no slack, so one padding sequence serves (b = 0)
    rounds = tuple(_own_free_call(filled, slots, 0) for filled, (slots, _) in zip(needs.filled, needs.slots))
    # the conv's rows must cover C*: its chunks follow from C* (at least the compact padding rows' and one
    # per padding segment beyond the real segments' own)
    conv_b = rung(needs.conv.count)  # every segment may end anywhere
    conv_sequences = 2 * conv_b
    conv_chunks = rung(needs.conv.chunks + -(-(c_star - needs.compact) // CHUNK) + conv_sequences - needs.conv.count)
    conv = (conv_sequences, conv_chunks, CHUNK * conv_chunks - (CHUNK - 1) * conv_b)
    p = c_star - needs.compact
    k_star = rung(needs.total_keys + p)
    count = s_star - s
    max_k = rung(max(needs.max_k, -(-(k_star - needs.total_keys) // count)))
    return (c_star, rounds, conv, (s_star, k_star, max_k, max_k))


def fits(bucket: tuple, needs: Needs) -> bool:
    """Whether a layout pads to `bucket` (another layout's, a held graph's) without changing a real row."""
    c_star, rounds, conv, (s_star, k_star, max_q, max_k) = bucket
    p = c_star - needs.compact
    count = s_star - len(needs.queries)
    extra_keys = k_star - needs.total_keys
    return (
        len(rounds) == len(needs.rounds)
        and 1 <= count <= p
        and extra_keys >= p
        and max(needs.max_k, -(-extra_keys // count)) <= min(max_q, max_k)
        and all(_fits_free(call, filled) for call, filled in zip(rounds, needs.filled))
        and _fits_free(conv, needs.conv)
        and conv[2] - needs.compact >= p  # the conv's padding covers the compact padding rows
    )


# What a bucket costs the GPU per unit, in compact rows (a compact row: the GEMMs, norms and MLP of every
# layer for one row, forward and backward): a GDN chunk of 64 (the chunked kernels run a block per chunk,
# full or not) and a conv row, measured on the H200 at 4B widths (bench/shared_prefix_buckets.py, `COST`,
# says from what). Attention's padding is a few segments of padding rows: left out.
GDN_CHUNK_COST = 10.7
CONV_ROW_COST = 0.018


def cost(bucket: tuple) -> float:
    """A bucket's GPU work in compact rows (the compact row, every GDN round's chunks, the conv's rows), to
    compare buckets: which held one to pad to, and whether it is worth padding to rather than capturing."""
    c_star, rounds, conv, _ = bucket
    return c_star + GDN_CHUNK_COST * sum(chunks for _, chunks, _ in rounds) + CONV_ROW_COST * conv[2]


REUSE = 1.4  # a layout pads to a held graph's bucket if that costs at most this much more than its own (a
# capture costs about 4 replayed steps: padding 40% more pays until the layout recurs about 10 times)


def _merge_free(calls) -> tuple[int, int, int]:
    """A free-rows call `(N*, NT*, R*)` that every layout fitting one of `calls` fits: the largest `b`, and
    for each call as many more sequences as its `b` grew and as many more chunks as its sequences grew."""
    bs = [(CHUNK * chunks - rows) // (CHUNK - 1) for _, chunks, rows in calls]
    b = max(bs)
    sequences = max(n + b - bi for (n, _, _), bi in zip(calls, bs))
    chunks = max(nt + sequences - n for n, nt, _ in calls)
    return sequences, chunks, CHUNK * chunks - (CHUNK - 1) * b


def merge(buckets) -> tuple | None:
    """A bucket that holds every one of `buckets` in each count, built so that a layout that fits one of them
    fits it too (each count's rule below says why); None when their GDN rounds differ in number (other tree
    structures)."""
    if len({len(b[1]) for b in buckets}) != 1:
        return None
    s_star = max(b[3][0] for b in buckets)
    c_star = max(b[0] + s_star - b[3][0] for b in buckets)  # a padding row per padding segment, as before
    k_star = max(b[3][1] + c_star - b[0] for b in buckets)  # the padding rows' keys, as before
    # a padding segment's keys: (extra_i + dK) / (count_i + dS) <= max(M_i, dK / dS) (the mediant), or
    # M_i + dK when no segment is added
    max_seqlen = max(
        max(m, -(-(k_star - k) // (s_star - s))) if s_star > s else m + k_star - k
        for s, k, m in ((b[3][0], b[3][1], min(b[3][2], b[3][3])) for b in buckets)
    )
    rounds = tuple(_merge_free(calls) for calls in zip(*(b[1] for b in buckets)))
    n, nt, rows = _merge_free([b[2] for b in buckets])
    b = (CHUNK * nt - rows) // (CHUNK - 1)
    nt = max(nt, -(-(c_star + (CHUNK - 1) * b) // CHUNK))  # the conv's rows cover C*
    conv = (n, nt, CHUNK * nt - (CHUNK - 1) * b)
    return (c_star, rounds, conv, (s_star, k_star, max_seqlen, max_seqlen))


def choose_bucket(needs: Needs, held=(), own: tuple | None = None) -> tuple:
    """The bucket a layout pads to: the cheapest of `held` (buckets of captured graphs) that it fits and that
    costs at most `REUSE` times its own bucket (a replay instead of a capture); else, to capture, the merge
    of its own bucket with every held one of its tree shape, or else the cheapest merge with one of them,
    within the same budget (a bucket that every layout of those fits: the next layout that falls between
    held buckets replays instead of capturing); else its own bucket (`own`, when the caller has it)."""
    own = own_bucket(needs) if own is None else own
    budget = REUSE * cost(own)
    usable = [b for b in held if fits(b, needs) and cost(b) <= budget]
    if usable:
        return min(usable, key=cost)
    same = [b for b in held if len(b[1]) == len(own[1])]  # buckets of the same tree shape
    if len(same) > 1 and _worth(everything := merge((own, *same)), own, needs, budget):
        return everything  # every layout that fits a held bucket fits it too
    pairs = [m for m in (merge((own, b)) for b in same) if _worth(m, own, needs, budget)]
    return min(pairs, key=cost) if pairs else own


class PaddingRegret:
    """Rent or buy for held buckets (an alternative to the fixed `REUSE` bound, measured by the bucket bench only).

    `choose_bucket` may keep a layout padding to a held bucket up to `REUSE` times its own bucket's cost, and
    merges make held buckets wide: under drawn lengths every layout of a loop can end up on one merged bucket
    (C*/C 1.155 at n=8 P=4096, `docs/cuda_graphs.md`). Here each held bucket owes the padding it has cost the
    layouts that padded to it, in steps of their own work (`cost(held) / cost(own) - 1` a step), and keeps their
    own buckets. Once a bucket owes a capture (`capture_steps` steps: the rent has paid for the purchase), the
    next layout that would pad to it captures the merge of those own buckets instead, when that costs less: a
    bucket that fits the layouts that came, not the ones that made the old merge."""

    def __init__(self, capture_steps: float = 4.2, keep: int = 16):
        self.capture_steps, self.keep = capture_steps, keep
        self.owed: dict[tuple, float] = {}
        self.owns: dict[tuple, list[tuple]] = {}

    def choose(self, needs: Needs, held=()) -> tuple:
        own = own_bucket(needs)
        chosen = choose_bucket(needs, held, own)
        self.owed = {b: v for b, v in self.owed.items() if b in held}  # evicted buckets owe nothing
        self.owns = {b: v for b, v in self.owns.items() if b in held}
        if chosen not in held or chosen == own:
            return chosen
        owns = self.owns.setdefault(chosen, [])
        owns.append(own)
        del owns[: -self.keep]
        self.owed[chosen] = self.owed.get(chosen, 0.0) + cost(chosen) / cost(own) - 1
        if self.owed[chosen] < self.capture_steps:
            return chosen
        tight = merge(tuple(dict.fromkeys(owns)))
        if tight is None or not fits(tight, needs) or cost(tight) >= cost(chosen):
            return chosen  # nothing cheaper to buy: the rent stays owed, and the next layout tries again
        self.owed.pop(chosen)  # bought: its layouts' padding is paid for
        self.owns.pop(chosen)
        return tight


def _worth(merged: tuple | None, own: tuple, needs: Needs, budget: float) -> bool:
    """Whether to capture a merge rather than the own bucket: it holds more than the own bucket (beyond
    `max_seqlen`, which a merge with a bucket that the own one holds may still raise: else it would only
    pad more), the layout fits it, and it costs at most `budget`."""
    if merged is None or (merged[:3] == own[:3] and merged[3][:2] == own[3][:2]):
        return False
    return fits(merged, needs) and cost(merged) <= budget


def padded_host(
    layout, plan: dict, lm: dict, kernel_size: int, held=(), arena: Arena | None = None,
    regret: PaddingRegret | None = None, gate=None,
) -> tuple[dict | None, tuple | None, float]:
    """Every host array of the plan (`build_plan`'s `host`) padded to a bucket (`choose_bucket`), the bucket,
    and the layout's own work (`cost` of its own bucket). `plan`: the plan's own arrays (compact_src, expand_index,
    cu_seqlens, positions), `lm` the LM rows' (nothing pads those); the mixers' arrays are built here, padded from
    the start. `gate(own work, bucket work, held)` (`graphs.choice.Gate`) may decline the bucket: then
    `(None, None, own work)`, and the caller builds the unpadded arrays."""
    arena = arena or Arena()
    pieces = gdn_pieces(layout)
    segs, lengths, _, _, state_rows = look_back(layout, kernel_size)
    keys = layout.offset[segs] + lengths
    needs = Needs.of(layout, pieces, lengths, keys)
    own = own_bucket(needs)
    bucket = choose_bucket(needs, held, own) if regret is None else regret.choose(needs, held)
    work = cost(own)
    if gate is not None and not gate(work, cost(bucket), bucket in held):
        return None, None, work
    c = needs.compact
    c_star = bucket[0]
    p = c_star - c
    compact_src = arena.take(c_star)
    compact_src[:c] = plan["compact_src"]
    compact_src[c:] = 0
    positions = plan["positions"]
    shape = (*positions.shape[:-1], c_star)
    padded_positions = arena.take(math.prod(shape), positions.dtype).reshape(shape)
    padded_positions[..., :c] = positions
    padded_positions[..., c:] = counting(p)
    cu = plan["cu_seqlens"]
    cu_seqlens = arena.take(len(cu) + 1, np.int32)
    cu_seqlens[:-1] = cu
    cu_seqlens[-1] = c_star
    host = {
        "plan": {
            "compact_src": compact_src,
            "expand_index": plan["expand_index"],
            "cu_seqlens": cu_seqlens,
            "positions": padded_positions,
        },
        "gdn": pad_gdn(pieces, needs, bucket[1], c, p, arena),
        "conv": _pad_conv(state_rows, kernel_size, needs, bucket[2], c, p, arena),
        "attention": _pad_attention(layout, segs, needs, bucket[3], c, p, arena),
        "lm": lm,
    }
    return host, bucket, work


_MARK = 1 << 48  # ranges starting here count rows of a padding cycle, not compact rows (see `_cycled`)


def _cycled(index: np.ndarray, c: int, p: int) -> np.ndarray:
    """`index` with each value `_MARK * j + k` (k < _MARK, j >= 1) replaced by the padding row `c + k % p`: runs
    of padding rows built by `ranges` beside real ones, each counting from 0 where it starts at a mark."""
    marked = index >= _MARK
    index[marked] = c + (index[marked] % _MARK) % p
    return index


def pad_gdn(pieces: RoundPieces, needs: Needs, calls: tuple, c: int, p: int, arena: Arena | None = None) -> dict:
    """Every real sequence is filled to whole chunks, and every round (round 0 too, when it had no rows) gets
    padding sequences; fill and padding rows read the compact padding rows (repeated as needed). The compact
    padding rows keep round 0's first padding outputs (repeated when round 0 has fewer padding rows: those
    outputs are never read and their gradient is zero, so the backward's `index_copy_` of repeated indices
    writes zeros either way). From round 1 on, padding sequences start from the zero state (so every round
    picks from zeros: `zero` is always set).

    Per round, its real sequences, each its parent's tail, its own rows and its fill rows, then its padding
    sequences: the fill rows of a round count through the padding rows from `c` on, and so do its padding
    sequences' (each from `c` again per round)."""
    arena = arena or Arena()
    rounds = len(calls)
    counts = pieces.counts
    lengths, tails, owns = pieces.lengths, pieces.tails, pieces.owns
    fill = CHUNK * -(-lengths // CHUNK) - lengths
    real_first = list(itertools.accumulate(counts[:-1], initial=0))  # each round's first real sequence
    # three pieces per real sequence (tail, own, fill); each round's fill rows count through the padding rows
    # from 0: from a mark of their own (see `_cycled`), less the fill rows of earlier rounds
    real = np.empty((len(lengths), 2, 3), dtype=np.int64)  # [sequence, (start, size), piece]
    real[:, 0, 0], real[:, 0, 1] = pieces.tail_start, pieces.own_start
    real[:, 1, 0], real[:, 1, 1], real[:, 1, 2] = tails, owns, fill
    before = fill.cumsum() - fill  # fill rows of the sequences before each one
    earlier = [int(before[f]) if n else 0 for f, n in zip(real_first, counts)]
    marks = np.array([_MARK * (2 * r + 1) - e for r, e in enumerate(earlier)], dtype=np.int64)
    real[:, 0, 2] = before + marks.repeat(counts)
    # per round: its real sequences' pieces, then one per padding sequence (counting from 0 again)
    pads, parts, starts, sizes, padded_first = [], [], [], [], []
    first = 0  # a round's first sequence in the padded joint row
    for r, (real_filled, call) in enumerate(zip(needs.filled, calls)):
        pad = _pad_free(call, real_filled)
        real_filled = real_filled.values
        s0, s1 = real_first[r], real_first[r] + counts[r]
        starts += [real[s0:s1, 0].ravel(), _MARK * (2 * r + 2) + pad.cumsum() - pad]
        sizes += [real[s0:s1, 1].ravel(), pad]
        parts += [real_filled, pad]
        pads.append(pad)
        padded_first.append(first)
        first += counts[r] + len(pad)
    joint = np.concatenate(parts)
    cu_joint = arena.boundaries(joint)
    src = _cycled(arena.ranges(np.concatenate(starts), np.concatenate(sizes)), c, p)
    chunks_joint = chunk_indices(joint, arena, np.int32)
    offsets_joint = arena.boundaries(-(-joint // CHUNK))
    # each real sequence's place in the padded joint row: after the padding sequences of earlier rounds
    shift = np.array([a - b for a, b in zip(padded_first, real_first)], dtype=np.int64).repeat(counts)
    real_start = cu_joint[pieces.kept_seq + shift[pieces.kept_seq]].astype(np.int64)
    out_index = arena.take(c + p)
    ranges_into(out_index[:c], real_start + pieces.kept_off, pieces.kept_len)
    round0_pad = int(cu_joint[counts[0]])  # round 0's first padding row
    np.add(counting(p) % int(pads[0].sum()), round0_pad, out=out_index[c:])
    out = {"rounds": rounds}
    for r in range(rounds):
        s0, s1 = padded_first[r], padded_first[r] + counts[r] + len(pads[r])
        c0, c1 = int(offsets_joint[s0]), int(offsets_joint[s1])
        n = s1 - s0
        out |= {
            f"src{r}": src[cu_joint[s0] : cu_joint[s1]],
            f"cu{r}": np.subtract(cu_joint[s0 : s1 + 1], cu_joint[s0], out=arena.take(n + 1, np.int32)),
            f"chunks{r}": np.subtract(
                chunks_joint[c0:c1], np.array([s0, 0], np.int32), out=arena.take(2 * (c1 - c0), np.int32).reshape(-1, 2)
            ),
            f"offsets{r}": np.subtract(offsets_joint[s0 : s1 + 1], c0, out=arena.take(n + 1, np.int32)),
            f"export{r}": r + 1 < rounds,
        }
        if r:
            state = pieces.states[r]
            out[f"zero{r}"] = True
            padded_state = arena.take(n)
            if state is not None:
                np.add(state, 1, out=padded_state[: len(state)])
                np.maximum(padded_state[: len(state)], 0, out=padded_state[: len(state)])
            padded_state[counts[r] :] = 0
            out[f"state{r}"] = padded_state
    out |= {
        "out_index": out_index,
        "src": src,
        "cu_joint": cu_joint,
        "chunks_joint": chunks_joint,
        "offsets_joint": offsets_joint,
        # a padded plan always gathers: whether the rounds read the row in place depends on the layout
        "src_identity": False,
        "out_identity": False,
        "bucketed": True,
    }
    return out


def _pad_conv(state_rows: np.ndarray, width: int, needs: Needs, call: tuple, c: int, p: int, arena: Arena) -> dict:
    """Padding segments tile the compact padding rows and, past `C*`, `extra_src` rows gathered from them:
    the conv's rows are free, so its segments and chunks are bucketed as the GDN rounds' are."""
    pad = _pad_free(call, needs.conv)
    all_lengths = np.concatenate([needs.conv.values, pad])
    s = len(state_rows)
    rows = arena.take((s + len(pad)) * width).reshape(-1, width)
    rows[:s] = state_rows
    rows[s:] = -1
    extra = arena.take(call[2] - c - p)  # copies of the padding rows, repeated as needed
    np.add(counting(len(extra)) % p, c, out=extra)
    return {
        "kernel_size": width,
        # the gathered look-back rows: not built for a padded plan (shared_prefix_causal_conv1d refuses it)
        "segment_cu": arena.boundaries(all_lengths),
        "segment_chunks": chunk_indices(all_lengths, arena, np.int32),
        "state_rows": rows,
        "extra_src": extra,
    }


def _pad_attention(layout, segs: np.ndarray, needs: Needs, call: tuple, c: int, p: int, arena: Arena) -> dict:
    """Padding segments split the `P` compact padding rows (queries) and read padding rows as keys:
    bottom-right causal, each padding query sees its own segment's keys only."""
    s_star, k_star, max_q, max_k = call
    count = s_star - len(needs.queries)
    keys = needs.total_keys
    q_pad = _split(p, count)
    k_pad = _split(k_star - keys, count)  # >= q_pad part by part: both split the same way and k_star - keys >= p
    # each padding segment's keys: (k - q) padding rows (counting from the first again), then its own queries' rows
    q_start = c + np.cumsum(q_pad) - q_pad
    kv_src = arena.take(k_star)
    attention_keys(layout, segs, out=kv_src[:keys])
    ranges_into(kv_src[keys:], interleave(np.full(count, _MARK, dtype=np.int64), q_start), interleave(k_pad - q_pad, q_pad))
    _cycled(kv_src[keys:], c, p)
    return {
        "max_q": max_q,
        "max_k": max_k,
        "kv_src": kv_src,
        "cu_q": arena.boundaries(np.concatenate([needs.queries, q_pad])),
        "cu_k": arena.boundaries(np.concatenate([needs.keys, k_pad])),
    }
