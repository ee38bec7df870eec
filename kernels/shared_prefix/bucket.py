"""Padding a plan up to bucket counts, so that CUDA graphs replay across batches whose layouts differ.

A captured graph fixes every shape and host int its kernels read. In a shared-prefix step those come
from a few counts per mixer, not from the lengths one by one: the compact row's length `C`; per GDN
round its sequences, chunks of 64 and rows; the conv's segments, chunks and rows; attention's segments,
gathered keys and `max_seqlen`s. `pad_host` rounds each count up to its bucket and adds padding that no
real row reads, so two layouts of one bucket have equal shapes and host ints, and differ only in the
contents of the index tensors (copied into a graph's static buffers per step):

- the compact row gets `P = C* - C >= 1` padding rows at its end: token id of packed row 0 (any valid
  id), positions counting from 0, no LM row and no packed position (nothing scores them, nothing
  expands them: their gradient is exactly zero, and so is every contribution they make to a weight's
  gradient);
- every GDN round gets padding sequences of its own (zero initial state, final states never read),
  the conv padding segments of their own (zero look-back state), attention padding segments whose keys
  are padding rows: a sequence boundary in every mixer, so no real row reads a padding row.

Counts go up a geometric ladder (`rung`, ratio 9/8: at most 12.5% more than needed). Every chunk
table entry is a real chunk of a real (or padding) sequence: the tables stay what the kernels are
built for. A mixer whose rows are free (GDN rounds gather their rows; the conv gathers rows beyond `C*`
as needed) keeps rows and chunks both fixed with one padding sequence per sequence it pads for: each
sequence's last chunk holds 1 to 64 rows, so a padding sequence can absorb up to 63 rows of that
slack (`_free_rows`). Attention reads the compact row's queries in place and needs no chunk table.
"""

from __future__ import annotations

import numpy as np

from .gdn import CHUNK, chunk_indices
from .rows import boundaries, counting, ranges

RATIO = (9, 8)  # the ladder's ratio: a bucket holds at most 12.5% more than the batch needs


def rung(x: int) -> int:
    """The smallest ladder value >= x (1, 2, ..., 8, 9, 11, 13, 15, 17, 20, ...: each about 9/8 of the last)."""
    value = 1
    while value < x:
        value = max(value + 1, -(-value * RATIO[0] // RATIO[1]))
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


def _free_rows(lengths: np.ndarray, extra_rows: int, slots: int) -> tuple[int, int, int]:
    """Bucket counts (sequences, chunks, rows) of a varlen call whose row count is free, padding at least
    `extra_rows` rows: the real sequences' slack (rows short of their last chunk, 0 to 63 each) varies with
    the layout, so `rung(slots)` padding sequences or more absorb it and rows and chunks both stay fixed.
    `slots` (>= the sequences) counts the sequences the layout's structure may have, so that a sequence
    that is empty in one layout (a node's tail on a chunk boundary) does not change the bucket."""
    n = len(lengths)
    n_b = rung(max(slots, n))
    sequences = 2 * n_b
    chunks = rung(chunks_of(lengths) + (sequences - n) + -(-extra_rows // CHUNK))
    rows = CHUNK * chunks - (CHUNK - 1) * n_b
    return sequences, chunks, rows


def _pad_call(lengths: np.ndarray, extra_rows: int, slots: int = 0) -> tuple[tuple[int, int, int], np.ndarray]:
    """(bucket counts, padding sequence lengths) of a free-rows varlen call (see `_free_rows`)."""
    sequences, chunks, rows = _free_rows(lengths, extra_rows, slots)
    pad = pad_lengths(sequences - len(lengths), rows - int(lengths.sum()), chunks - chunks_of(lengths))
    return (sequences, chunks, rows), pad


def _cycle(first: int, count: int, n: int) -> np.ndarray:
    """`n` rows of the padding region `[first, first + count)`, repeated as needed."""
    return first + np.arange(n, dtype=np.int64) % count


def _split(total: int, parts: int) -> np.ndarray:
    """`total` in `parts` near-equal parts, the larger ones first."""
    base, extra = divmod(total, parts)
    return base + (np.arange(parts) < extra).astype(np.int64)


def compact_bucket(compact_length: int, attention_segments: int) -> int:
    """`C*`: room for at least one padding row per padding attention segment."""
    return rung(compact_length + rung(attention_segments + 1) - attention_segments)


def pad_host(host: dict, layout) -> tuple[dict, tuple]:
    """The plan's host arrays (`build_plan`'s `host`) padded to their bucket, and the bucket's counts."""
    c = layout.compact_length
    att = host["attention"]
    segments_a = len(att["cu_q"]) - 1
    c_star = compact_bucket(c, segments_a)
    p = c_star - c
    plan = dict(host["plan"])
    plan["compact_src"] = np.concatenate([plan["compact_src"], np.zeros(p, dtype=np.int64)])
    positions = plan["positions"]
    pad_pos = np.broadcast_to(counting(p).astype(positions.dtype), (*positions.shape[:-1], p))
    plan["positions"] = np.ascontiguousarray(np.concatenate([positions, pad_pos], axis=-1))
    plan["cu_seqlens"] = np.append(plan["cu_seqlens"], np.int32(c_star)).astype(np.int32)
    gdn, gdn_bucket = _pad_gdn(host["gdn"], c, p, round_slots(layout))
    conv, conv_bucket = _pad_conv(host["conv"], c, p)
    attention, att_bucket = _pad_attention(att, c, p)
    out = {**host, "plan": plan, "gdn": gdn, "conv": conv, "attention": attention}
    return out, (c_star, gdn_bucket, conv_bucket, att_bucket)


def round_slots(layout) -> list[int]:
    """Per GDN round, the sequences its structure allows: round 0 every root and singleton, round l every
    node of level l - 1 (its tail alone) and every segment of level l (the tail + child)."""
    shared, level = layout.shared, layout.level
    slots = [int((level == 0).sum())]
    for lvl in range(1, layout.depth + 1):
        slots.append(int((shared & (level == lvl - 1)).sum() + (level == lvl).sum()))
    return slots


def _pad_gdn(host: dict, c: int, p: int, slots: list[int]) -> tuple[dict, tuple]:
    """Every round (round 0 too, when it had no rows) gets padding sequences, which read the compact padding
    rows (repeated as needed); the compact padding rows keep round 0's first padding outputs (repeated when
    round 0 has fewer padding rows: those outputs are never read, their gradient is zero). From round 1 on,
    padding sequences start from the zero state (so every round picks from zeros: `zero` is always set)."""
    out = {"rounds": host["rounds"]}
    real_rows, pad_rows, parts, buckets = [], [], [], []
    for r in range(host["rounds"]):
        present = f"src{r}" in host
        lengths = np.diff(host[f"cu{r}"]).astype(np.int64) if present else np.zeros(0, dtype=np.int64)
        (n_star, nt_star, rows_star), pad = _pad_call(lengths, 0, slots[r])
        real = int(lengths.sum())
        pad_src = _cycle(c, p, int(pad.sum()))
        src = np.concatenate([host[f"src{r}"], pad_src]) if present else pad_src
        all_lengths = np.concatenate([lengths, pad])
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
        pad_rows.append(rows_star - real)
        parts.append(all_lengths)
        buckets.append((n_star, nt_star, rows_star))
    # rows of cat(every round's rows): each round's real rows, then its padding rows
    round_start = np.cumsum([0] + [a + b for a, b in zip(real_rows, pad_rows)])[:-1]
    real_start = np.cumsum([0] + real_rows)[:-1]
    index = host["out_index"]
    of = np.searchsorted(real_start, index, side="right") - 1
    shifted = index - real_start[of] + round_start[of]
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
    return out, tuple(buckets)


def _pad_conv(host: dict, c: int, p: int) -> tuple[dict, tuple]:
    """Padding segments tile the compact padding rows and, past `C*`, `extra_src` rows gathered from them:
    the conv's rows are free, so its segments and chunks are bucketed as the GDN rounds' are."""
    lengths = np.diff(host["segment_cu"]).astype(np.int64)
    (s_star, nt_star, rows_star), pad = _pad_call(lengths, p)
    all_lengths = np.concatenate([lengths, pad])
    width = host["kernel_size"]
    out = {
        "kernel_size": width,
        # the gathered look-back rows: not built for a padded plan (shared_prefix_causal_conv1d refuses it)
        "segment_cu": boundaries(all_lengths).astype(np.int32),
        "segment_chunks": chunk_indices(all_lengths, dtype=np.int32),
        "state_rows": np.concatenate([host["state_rows"], np.full((len(pad), width), -1, dtype=np.int64)]),
        "extra_src": _cycle(c, p, rows_star - c - p),
    }
    return out, (s_star, nt_star, rows_star)


def _pad_attention(host: dict, c: int, p: int) -> tuple[dict, tuple]:
    """Padding segments split the `P` compact padding rows (queries) and read padding rows as keys:
    bottom-right causal, each padding query sees its own segment's keys only."""
    q_lengths = np.diff(host["cu_q"]).astype(np.int64)
    k_lengths = np.diff(host["cu_k"]).astype(np.int64)
    s = len(q_lengths)
    s_star = rung(s + 1)
    count = s_star - s  # <= p by compact_bucket
    keys = int(k_lengths.sum())
    k_star = rung(keys + p)
    q_pad = _split(p, count)
    k_pad = _split(k_star - keys, count)  # >= q_pad part by part: both split the same way and k_star - keys >= p
    max_q = rung(max(int(host["max_q"]), int(q_pad.max())))
    max_k = rung(max(int(host["max_k"]), int(k_pad.max()), max_q))
    # each padding segment's keys: (k - q) padding rows, then its own queries' rows
    q_start = c + np.cumsum(q_pad) - q_pad
    extra = k_pad - q_pad
    pad_kv = np.concatenate([
        np.concatenate([_cycle(c, p, int(e)), ranges(np.array([s0]), np.array([q]))])
        for e, s0, q in zip(extra.tolist(), q_start.tolist(), q_pad.tolist())
    ])
    out = {
        "max_q": max_q,
        "max_k": max_k,
        "kv_src": np.concatenate([host["kv_src"], pad_kv]),
        "cu_q": boundaries(np.concatenate([q_lengths, q_pad])).astype(np.int32),
        "cu_k": boundaries(np.concatenate([k_lengths, k_pad])).astype(np.int32),
    }
    return out, (s_star, k_star, max_q, max_k)
