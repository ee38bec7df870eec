"""The padding of a plan to bucket counts as first written (`kernels/shared_prefix/bucket.py` at 28e09c8),
frozen: the reference that the fast padding is compared with, field by field (`test_padding_reference.py`).

Ladder, bucket choice and padding, one numpy call at a time, from an unpadded plan's host arrays (read back
off the unpadded plan by `host_arrays`). Do not speed this copy up: it is what "the padded plan is unchanged"
means.
"""


from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from patchgen.kernels.shared_prefix.attention import attention_index
from patchgen.kernels.shared_prefix.conv import conv_index
from patchgen.kernels.shared_prefix.gdn import gdn_index
from patchgen.kernels.shared_prefix.lm_rows import lm_index
from patchgen.kernels.shared_prefix.plan import Plan, _upload

CHUNK = 64


def counting(n):
    return np.arange(n, dtype=np.int64)


def ranges(starts, lengths):
    pieces = [np.arange(s, s + n, dtype=np.int64) for s, n in zip(np.asarray(starts).tolist(), np.asarray(lengths).tolist())]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def boundaries(lengths):
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)


def chunk_indices(lengths, dtype=np.int64):
    rows = [(s, i) for s, n in enumerate(np.asarray(lengths).tolist()) for i in range(-(-n // CHUNK))]
    return np.array(rows, dtype=dtype).reshape(-1, 2)

RATIO = (9, 8)  # the ladder's ratio: a bucket holds at most 12.5% more than the batch needs
COMPACT_RATIO = (17, 16)  # the compact row's ladder: at most 6.25% (its rows are the GEMMs', most of a step)


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
    per = np.ones(count, dtype=np.int64)
    per[0] += chunks - count
    slack = CHUNK * chunks - rows  # rows short of whole chunks, at most CHUNK - 1 per sequence
    short = np.minimum(CHUNK - 1, np.maximum(0, slack - (CHUNK - 1) * np.arange(count)))
    return CHUNK * per - short


# A varlen call whose rows are free (the GDN rounds gather theirs; the conv gathers rows past C*) is
# bucketed as (sequences N*, chunks NT*, rows R* = 64 NT* - 63 b). Its real sequences leave `slack` rows
# short of whole last chunks (0 to 63 each, varying with the layout); k = N* - n >= b padding sequences,
# each at least one chunk, absorb the remaining 63 b - slack, so rows and chunks both stay fixed for every
# layout whose slack is at most 63 b. The conv's own b is the rung of its segments (each may end anywhere),
# so every layout of the structure fits it whatever its lengths. A GDN round's sequences are filled to
# whole chunks (`_fill_chunks`): no slack, b = 0, and one padding sequence (k >= 1) serves.


def _slack(lengths: np.ndarray) -> int:
    return CHUNK * chunks_of(lengths) - int(lengths.sum())


def _own_free_call(lengths: np.ndarray, slots: int, slack_slots: int) -> tuple[int, int, int]:
    b = rung(slack_slots) if slack_slots else 0
    sequences = rung(max(slots, len(lengths))) + max(1, b)
    chunks = rung(chunks_of(lengths) + sequences - len(lengths))
    return sequences, chunks, CHUNK * chunks - (CHUNK - 1) * b


def _fits_free(call: tuple[int, int, int], lengths: np.ndarray) -> bool:
    sequences, chunks, rows = call
    b = (CHUNK * chunks - rows) // (CHUNK - 1)
    k = sequences - len(lengths)
    return k >= max(1, b) and chunks - chunks_of(lengths) >= k and _slack(lengths) <= (CHUNK - 1) * b


def _pad_free(call: tuple[int, int, int], lengths: np.ndarray) -> np.ndarray:
    """The padding sequences' lengths that take a free-rows call of `lengths` to its bucket `call`."""
    sequences, chunks, rows = call
    return pad_lengths(sequences - len(lengths), rows - int(lengths.sum()), chunks - chunks_of(lengths))


def _cycle(first: int, count: int, n: int) -> np.ndarray:
    """`n` rows of the padding region `[first, first + count)`, repeated as needed."""
    return first + np.arange(n, dtype=np.int64) % count


def _split(total: int, parts: int) -> np.ndarray:
    """`total` in `parts` near-equal parts, the larger ones first."""
    base, extra = divmod(total, parts)
    return base + (np.arange(parts) < extra).astype(np.int64)


def round_slots(layout) -> list[tuple[int, int]]:
    """Per GDN round, the sequences its structure allows and how many of them may end off a chunk boundary:
    round 0 every root (up to its last chunk boundary) and singleton (anywhere), round l every node of
    level l - 1 (its tail alone) and every segment of level l (the tail + child)."""
    shared, level = layout.shared, layout.level
    slots = [(int((level == 0).sum()), int(((level == 0) & ~shared).sum()))]
    for lvl in range(1, layout.depth + 1):
        n = int((shared & (level == lvl - 1)).sum() + (level == lvl).sum())
        slots.append((n, n))
    return slots


def _fill_chunks(gdn: dict, rounds) -> list[np.ndarray]:
    """Per GDN round, its sequences' lengths up to whole chunks. A sequence whose final state a later round
    reads (a root up to its last chunk boundary, a nested node's segment) already ends on one; the others
    (singletons, the last round's segments, tails alone) end anywhere and nothing reads their final state,
    so rows appended after their last real row change no real output (the recurrence is causal) and get no
    gradient. Checked here: a read state of a sequence that does not end on a chunk boundary is an error."""
    for r in range(1, len(rounds)):
        state = gdn.get(f"state{r}")
        if state is None or not len(rounds[r - 1]):
            continue
        read = state - (1 if gdn.get(f"zero{r}") else 0)
        if (rounds[r - 1][read[read >= 0]] % CHUNK).any():
            raise AssertionError(f"GDN round {r} reads the final state of a round {r - 1} sequence that ends mid-chunk")
    return [CHUNK * -(-lengths // CHUNK) for lengths in rounds]


@dataclass(frozen=True, eq=False)
class Needs:
    """What a layout's plan needs of a bucket: its compact length, every call's sequence lengths."""

    compact: int
    rounds: tuple[np.ndarray, ...]  # per GDN round, its sequences' lengths (empty when it has none)
    filled: tuple[np.ndarray, ...]  # the same, each up to its last chunk's end (`_fill_chunks`)
    slots: tuple[tuple[int, int], ...]  # per GDN round, its structure's sequences and those with slack (`round_slots`)
    conv: np.ndarray  # the conv's segment lengths (they tile the compact row)
    queries: np.ndarray  # attention's segment query and key lengths
    keys: np.ndarray
    max_k: int

    @classmethod
    def of(cls, host: dict, layout) -> Needs:
        gdn, att = host["gdn"], host["attention"]
        rounds = tuple(
            np.diff(gdn[f"cu{r}"]).astype(np.int64) if f"cu{r}" in gdn else np.zeros(0, dtype=np.int64)
            for r in range(gdn["rounds"])
        )
        return cls(
            compact=layout.compact_length,
            rounds=rounds,
            filled=tuple(_fill_chunks(gdn, rounds)),
            slots=tuple(round_slots(layout)),
            conv=np.diff(host["conv"]["segment_cu"]).astype(np.int64),
            queries=np.diff(att["cu_q"]).astype(np.int64),
            keys=np.diff(att["cu_k"]).astype(np.int64),
            max_k=int(att["max_k"]),
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
    conv_b = rung(len(needs.conv))  # every segment may end anywhere
    conv_sequences = 2 * conv_b
    conv_chunks = rung(chunks_of(needs.conv) + -(-(c_star - needs.compact) // CHUNK) + conv_sequences - len(needs.conv))
    conv = (conv_sequences, conv_chunks, CHUNK * conv_chunks - (CHUNK - 1) * conv_b)
    p = c_star - needs.compact
    k_star = rung(int(needs.keys.sum()) + p)
    count = s_star - s
    max_k = rung(max(needs.max_k, -(-(k_star - int(needs.keys.sum())) // count)))
    return (c_star, rounds, conv, (s_star, k_star, max_k, max_k))


def fits(bucket: tuple, needs: Needs) -> bool:
    """Whether a layout pads to `bucket` (another layout's, a held graph's) without changing a real row."""
    c_star, rounds, conv, (s_star, k_star, max_q, max_k) = bucket
    p = c_star - needs.compact
    count = s_star - len(needs.queries)
    extra_keys = k_star - int(needs.keys.sum())
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


def choose_bucket(needs: Needs, held=()) -> tuple:
    """The bucket a layout pads to: the cheapest of `held` (buckets of captured graphs) that it fits and that
    costs at most `REUSE` times its own bucket (a replay instead of a capture); else, to capture, the merge
    of its own bucket with every held one of its tree shape, or else the cheapest merge with one of them,
    within the same budget (a bucket that every layout of those fits: the next layout that falls between
    held buckets replays instead of capturing); else its own bucket."""
    own = own_bucket(needs)
    budget = REUSE * cost(own)
    usable = [b for b in held if fits(b, needs) and cost(b) <= budget]
    if usable:
        return min(usable, key=cost)
    same = [b for b in held if len(b[1]) == len(own[1])]  # buckets of the same tree shape
    if len(same) > 1 and _worth(everything := merge((own, *same)), own, needs, budget):
        return everything  # every layout that fits a held bucket fits it too
    pairs = [m for m in (merge((own, b)) for b in same) if _worth(m, own, needs, budget)]
    return min(pairs, key=cost) if pairs else own


def _worth(merged: tuple | None, own: tuple, needs: Needs, budget: float) -> bool:
    """Whether to capture a merge rather than the own bucket: it holds more than the own bucket (beyond
    `max_seqlen`, which a merge with a bucket that the own one holds may still raise: else it would only
    pad more), the layout fits it, and it costs at most `budget`."""
    if merged is None or (merged[:3] == own[:3] and merged[3][:2] == own[3][:2]):
        return False
    return fits(merged, needs) and cost(merged) <= budget


def pad_host(host: dict, layout, held=()) -> tuple[dict, tuple]:
    """The plan's host arrays (`build_plan`'s `host`) padded to a bucket (`choose_bucket`), and the bucket."""
    needs = Needs.of(host, layout)
    bucket = choose_bucket(needs, held)
    c = needs.compact
    c_star = bucket[0]
    p = c_star - c
    plan = dict(host["plan"])
    plan["compact_src"] = np.concatenate([plan["compact_src"], np.zeros(p, dtype=np.int64)])
    positions = plan["positions"]
    pad_pos = np.broadcast_to(counting(p).astype(positions.dtype), (*positions.shape[:-1], p))
    plan["positions"] = np.ascontiguousarray(np.concatenate([positions, pad_pos], axis=-1))
    plan["cu_seqlens"] = np.append(plan["cu_seqlens"], np.int32(c_star)).astype(np.int32)
    out = {
        **host,
        "plan": plan,
        "gdn": _pad_gdn(host["gdn"], needs, bucket[1], c, p),
        "conv": _pad_conv(host["conv"], needs, bucket[2], c, p),
        "attention": _pad_attention(host["attention"], needs, bucket[3], c, p),
    }
    return out, bucket


def _pad_gdn(host: dict, needs: Needs, calls: tuple, c: int, p: int) -> dict:
    """Every real sequence is filled to whole chunks, and every round (round 0 too, when it had no rows) gets
    padding sequences; fill and padding rows read the compact padding rows (repeated as needed). The compact
    padding rows keep round 0's first padding outputs (repeated when round 0 has fewer padding rows: those
    outputs are never read and their gradient is zero, so the backward's `index_copy_` of repeated indices
    writes zeros either way). From round 1 on, padding sequences start from the zero state (so every round
    picks from zeros: `zero` is always set)."""
    out = {"rounds": host["rounds"]}
    real_rows, pad_rows, parts, moved = [], [], [], []
    for r, (lengths, filled, call) in enumerate(zip(needs.rounds, needs.filled, calls)):
        pad = _pad_free(call, filled)
        real = int(filled.sum())
        # each real sequence's rows, then padding rows up to its last chunk's end (`_fill_chunks`)
        fill = filled - lengths
        fill_src = _cycle(c, p, int(fill.sum()))
        at = boundaries(filled)[:-1] + lengths  # where each sequence's fill rows go
        src = np.empty(real, dtype=np.int64)
        is_fill = np.zeros(real, dtype=bool)
        is_fill[ranges(at, fill)] = True
        src[is_fill] = fill_src
        if f"src{r}" in host:
            src[~is_fill] = host[f"src{r}"]
        moved.append(np.flatnonzero(~is_fill))  # a real row's place among the round's filled rows
        src = np.concatenate([src, _cycle(c, p, int(pad.sum()))])
        all_lengths = np.concatenate([filled, pad])
        out |= {
            f"src{r}": src,
            f"cu{r}": boundaries(all_lengths).astype(np.int32),
            f"chunks{r}": chunk_indices(all_lengths, dtype=np.int32),
            f"offsets{r}": boundaries(-(-all_lengths // CHUNK)).astype(np.int32),
            f"export{r}": r + 1 < host["rounds"],
        }
        if r:
            state = host.get(f"state{r}")
            real_state = np.zeros(0, np.int64) if state is None else state + (0 if host.get(f"zero{r}") else 1)
            out[f"zero{r}"] = True
            out[f"state{r}"] = np.concatenate([real_state, np.zeros(len(pad), dtype=np.int64)])
        real_rows.append(real)
        pad_rows.append(int(pad.sum()))
        parts.append(all_lengths)
    # rows of cat(every round's rows): each round's real rows, then its padding rows
    round_start = np.cumsum([0] + [a + b for a, b in zip(real_rows, pad_rows)])[:-1]
    real_start = np.cumsum([0] + [int(lengths.sum()) for lengths in needs.rounds])[:-1]
    index = host["out_index"]
    of = np.searchsorted(real_start, index, side="right") - 1
    # `moved` of every round, concatenated, is indexed by the unpadded rows of cat(every round's rows)
    shifted = np.concatenate(moved)[index] + round_start[of]
    out["out_index"] = np.concatenate([shifted, _cycle(round_start[0] + real_rows[0], pad_rows[0], p)])
    out["src"] = np.concatenate([out[f"src{r}"] for r in range(host["rounds"])])
    joint = np.concatenate(parts)
    out |= {
        "cu_joint": boundaries(joint).astype(np.int32),
        "chunks_joint": chunk_indices(joint, dtype=np.int32),
        "offsets_joint": boundaries(-(-joint // CHUNK)).astype(np.int32),
        # a padded plan always gathers: whether the rounds read the row in place depends on the layout
        "src_identity": False,
        "out_identity": False,
        "bucketed": True,
    }
    return out


def _pad_conv(host: dict, needs: Needs, call: tuple, c: int, p: int) -> dict:
    """Padding segments tile the compact padding rows and, past `C*`, `extra_src` rows gathered from them:
    the conv's rows are free, so its segments and chunks are bucketed as the GDN rounds' are."""
    pad = _pad_free(call, needs.conv)
    all_lengths = np.concatenate([needs.conv, pad])
    width = host["kernel_size"]
    return {
        "kernel_size": width,
        # the gathered look-back rows: not built for a padded plan (shared_prefix_causal_conv1d refuses it)
        "segment_cu": boundaries(all_lengths).astype(np.int32),
        "segment_chunks": chunk_indices(all_lengths, dtype=np.int32),
        "state_rows": np.concatenate([host["state_rows"], np.full((len(pad), width), -1, dtype=np.int64)]),
        "extra_src": _cycle(c, p, call[2] - c - p),
    }


def _pad_attention(host: dict, needs: Needs, call: tuple, c: int, p: int) -> dict:
    """Padding segments split the `P` compact padding rows (queries) and read padding rows as keys:
    bottom-right causal, each padding query sees its own segment's keys only."""
    s_star, k_star, max_q, max_k = call
    count = s_star - len(needs.queries)
    keys = int(needs.keys.sum())
    q_pad = _split(p, count)
    k_pad = _split(k_star - keys, count)  # >= q_pad part by part: both split the same way and k_star - keys >= p
    # each padding segment's keys: (k - q) padding rows, then its own queries' rows
    q_start = c + np.cumsum(q_pad) - q_pad
    pad_kv = np.concatenate([
        np.concatenate([_cycle(c, p, int(k - q)), ranges(np.array([s0]), np.array([q]))])
        for k, s0, q in zip(k_pad.tolist(), q_start.tolist(), q_pad.tolist())
    ])
    return {
        "max_q": max_q,
        "max_k": max_k,
        "kv_src": np.concatenate([host["kv_src"], pad_kv]),
        "cu_q": boundaries(np.concatenate([needs.queries, q_pad])).astype(np.int32),
        "cu_k": boundaries(np.concatenate([needs.keys, k_pad])).astype(np.int32),
    }


def host_arrays(plan) -> dict:
    """An unpadded plan's host arrays (`build_plan`'s `host`), read back off its tensors."""
    def a(t):
        return t.numpy()

    gdn = {"rounds": len(plan.gdn.rounds), "out_index": a(plan.gdn.out_index), "src": a(plan.gdn.src)}
    for r, rnd in enumerate(plan.gdn.rounds):
        if rnd is None:
            continue
        gdn |= {f"src{r}": a(rnd.src), f"cu{r}": a(rnd.cu_seqlens), f"chunks{r}": a(rnd.chunk_indices),
                f"offsets{r}": a(rnd.chunk_offsets), f"export{r}": rnd.export_state}
        if rnd.state_index is not None:
            gdn |= {f"zero{r}": rnd.zero_state, f"state{r}": a(rnd.state_index)}
    joint = plan.gdn.joint
    gdn |= {"cu_joint": a(joint.cu_seqlens), "chunks_joint": a(joint.chunk_indices),
            "offsets_joint": a(joint.chunk_offsets), "src_identity": plan.gdn.src_identity,
            "out_identity": plan.gdn.out_identity}
    conv, att, lm = plan.conv, plan.attention, plan.lm
    return {
        "plan": {"compact_src": a(plan.compact_src), "expand_index": a(plan.expand_index),
                 "cu_seqlens": a(plan.cu_seqlens), "positions": a(plan.position_ids)},
        "gdn": gdn,
        "conv": {"kernel_size": conv.kernel_size, "src": a(conv.src), "cu": a(conv.cu_seqlens),
                 "out_index": a(conv.out_index), "segment_cu": a(conv.segment_cu),
                 "segment_chunks": a(conv.segment_chunks), "state_rows": a(conv.state_rows)},
        "attention": {"max_q": att.max_seqlen_q, "max_k": att.max_seqlen_k, "kv_src": a(att.kv_src),
                      "cu_q": a(att.cu_seqlens_q), "cu_k": a(att.cu_seqlens_k)},
        "lm": {"length": lm.length, "rows": a(lm.rows), "label_src": a(lm.label_src), "inverse": a(lm.inverse)},
    }


def reference_padded_plan(plan, held=()):
    """The plan `build_plan(..., pad_to_bucket=True, held_buckets=held)` made of the unpadded `plan` of the
    same batch (on the CPU), by the padding above: the same assembly of tensors from host arrays."""
    host, bucket = pad_host(host_arrays(plan), plan.layout, held)
    dev = _upload(host, torch.device("cpu"))
    positions = dev["plan"]["positions"]
    if positions.dtype != plan.position_ids.dtype:
        positions = positions.to(plan.position_ids.dtype)
    return Plan(
        nodes=plan.nodes,
        packed_length=plan.packed_length,
        compact_length=bucket[0],
        compact_src=dev["plan"]["compact_src"],
        expand_index=dev["plan"]["expand_index"],
        position_ids=positions,
        cu_seqlens=dev["plan"]["cu_seqlens"],
        gdn=gdn_index(host["gdn"], dev["gdn"]),
        conv=conv_index(host["conv"], dev["conv"]),
        attention=attention_index(host["attention"], dev["attention"]),
        lm=lm_index(host["lm"], dev["lm"]),
        layout=plan.layout,
        level_cost=plan.level_cost,
        bucket=bucket,
        work=cost(own_bucket(Needs.of(host_arrays(plan), plan.layout))),  # what the layout's own bucket costs
    )
