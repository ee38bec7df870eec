"""Gated DeltaNet on the compact row: chunk-aligned rounds, one per level of the prefix tree.

For a shared node ending at offset `E`, `B = floor(E / 64) * 64`. Round 0 runs every root up to
its `B` from zero state (and every singleton whole) and exports the state at `B`. Round `l`
(one varlen call) runs, per node of level `l - 1`, its tail `[B, E)` alone (its outputs are the
tail's) and, per child, `tail + child` from the exported state: a nested child up to its own
`B`, exporting there for round `l + 1`; a leaf whole. The replayed tail outputs inside the child
sequences are dropped. Exporting only at multiples of 64 keeps the chunk partition of every
member identical to packed execution, which is what makes the split bit-identical with a chunked
kernel (exporting at `E` shifts the chunks and is not); a nested node is at least 64 rows long,
so the replayed rows always lie in the parent. With one level this is the two-round split (A, B).
Gradients reach every ancestor through the states: the backend must return `dh0` and accept `dht`.

The rounds are plain data (`GDNIndex.rounds`). A backend that exposes its forward and backward
stages runs every round of a layer in one autograd node (`gdn_rounds.py`: forward in order,
backward in reverse, `dh0` of round `l` handed to round `l - 1` as its `dht`), and when those stages
allow it, the ones that do not read the state once over every round's rows (`GDNIndex.joint`);
any other backend takes the loop below, one public call per round.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CudaGraphsUnavailable
from . import call_graphs
from .call_graphs import CALL_GRAPHS
from .gdn_rounds import gated_delta_rule_rounds, round_kernels, rounds_forward
from .layout import Layout
from .rows import Arena, counting, interleave

CHUNK = 64  # chunk size of the chunked GDN kernels (fla, ours); the split aligns to it


@dataclass(frozen=True, eq=False)
class GDNRound:
    """One varlen call: rows gathered from the compact row, their boundaries and chunk indices."""

    src: torch.Tensor  # [rows] compact row of each input row
    cu_seqlens: torch.Tensor  # [n + 1] int32, on the device
    cu_seqlens_cpu: torch.Tensor | None  # the same on the host, so a backend never copies it back (None in a
    # padded plan: a host copy is keyed by value, and a backend must read the device tables there)
    chunk_indices: torch.Tensor  # [chunks, 2] int32: (sequence, chunk within it), fla's layout
    chunk_offsets: torch.Tensor  # [n + 1] int32: first chunk of each sequence
    num_sequences: int
    rows: int  # input rows of this round (its slice of `GDNIndex.src`)
    state_index: torch.Tensor | None = None  # [n] row of the previous round's states (+1 if zero_state)
    zero_state: bool = False  # some sequence starts from zeros (a root shorter than 64)
    export_state: bool = False  # the next round starts from this round's final states


@dataclass(frozen=True, eq=False)
class GDNIndex:
    rounds: tuple[GDNRound | None, ...]  # round 0 is None when no root reaches 64 and there is no singleton
    out_index: torch.Tensor  # [C] row of cat(every round's outputs) for each compact row
    src: torch.Tensor  # [rows] cat(every round's src): one gather per input serves every round
    # The rounds read the compact row as it is (`src` is 0..C-1) and their outputs are it
    # (`out_index` is 0..C-1): no gather, no scatter. Known on the host when the plan is built;
    # true for chunk-aligned prefixes of one group (every tail empty, rounds in compact order).
    src_identity: bool = False
    out_identity: bool = False
    # every round's sequences as one varlen row (`src`'s rows): the chunk tables of the stages that
    # do not read the state, which a backend may run once for all rounds (`gdn_rounds.py`); the
    # chunks are each round's own, since chunks restart at every sequence start
    joint: GDNRound | None = None
    # padded to bucket counts (`bucket.py`): the backend must read every chunk table from the plan
    bucketed: bool = False

    @property
    def present(self) -> tuple[tuple[GDNRound, slice], ...]:
        """The rounds that have rows, each with its rows in `src` (and in `joint`)."""
        out, start = [], 0
        for rnd in self.rounds:
            if rnd is not None:
                out.append((rnd, slice(start, start + rnd.rows)))
                start += rnd.rows
        return tuple(out)

    @property
    def round_a(self) -> GDNRound | None:
        return self.rounds[0]

    @property
    def round_b(self) -> GDNRound:
        return self.rounds[1]

    @property
    def state_index(self) -> torch.Tensor:
        """Round 1's state rows (the one-level plan's `state_index`)."""
        return self.rounds[1].state_index

    @property
    def zero_state(self) -> bool:
        return self.rounds[1].zero_state


def chunk_indices(lengths, arena: Arena | None = None, dtype=np.int64) -> np.ndarray:
    """[chunks, 2]: (sequence, chunk within it) for chunks of 64, flash-linear-attention's layout."""
    counts = -(-np.asarray(lengths, dtype=np.int64) // CHUNK)
    ends = counts.cumsum()
    total = int(ends[-1]) if len(ends) else 0
    out = (arena or Arena()).take(2 * total, dtype).reshape(-1, 2)
    sequence = counting(len(counts)).repeat(counts)
    out[:, 0] = sequence
    np.subtract(counting(total), (ends - counts)[sequence], out=out[:, 1], casting="unsafe")
    return out


@dataclass(frozen=True, eq=False)
class RoundPieces:
    """The GDN rounds of a layout at the segment level (host, numpy): each round's sequences as two pieces
    of compact rows (the parent's tail, then the segment's own rows; round 0: its rows and an empty piece),
    the state each starts from, and which rows of which sequence hold each compact row's output. The
    unpadded index (`gdn_host_index`) and the padded one (`bucket.pad_gdn`) are both made from it."""

    tail_start: np.ndarray  # [n] per sequence of every round, in round order: first compact row of its tail
    tails: np.ndarray  # [n] the tail's rows
    own_start: np.ndarray  # [n] first compact row of its own rows
    owns: np.ndarray  # [n] its own rows
    lengths: np.ndarray  # [n] tails + owns
    counts: list[int]  # sequences per round
    states: list[np.ndarray | None]  # per round, its sequences' previous-round sequence (-1: zero state)
    # the kept pieces, in compact order: each a run of compact rows whose outputs are rows of one sequence
    kept_len: np.ndarray  # rows of each piece
    kept_seq: np.ndarray  # the sequence (numbered over every round) that holds it
    kept_off: np.ndarray  # its first row's place inside that sequence


def gdn_pieces(layout: Layout) -> RoundPieces:
    """Every round's sequences and kept pieces (see `RoundPieces`), for every round at once.

    A sequence is a round-0 entry (a root up to its last chunk boundary, a singleton whole), a node's
    tail alone (in the round after the node's level) or a child with its parent's tail in front (in the
    round of the child's level). A round holds its entries by segment, a node's tail alone before its
    children (a parent comes before its subtree): one sort by (round, segment) orders them all."""
    start, length, offset = layout.start, layout.length, layout.offset
    end = offset + length
    shared, level, parent = layout.node >= 0, layout.level, layout.parent
    n_seg = len(start)
    aligned_end = (end // CHUNK) * CHUNK  # a shared segment's state is exported there
    own = np.where(shared, aligned_end - offset, length)  # the rows a segment runs itself
    tail = end - aligned_end  # of every segment; read at parents
    tail_begin = start + aligned_end - offset
    has_parent = parent >= 0
    roots = (~has_parent & (own > 0)).nonzero()[0]  # round 0
    alone = (shared & (tail > 0)).nonzero()[0]  # a node's tail alone, the round after its level
    children = has_parent.nonzero()[0]
    up = parent[children]
    # every entry: its round, the segment it sorts by, its parent node (-1 in round 0), its own segment (-1 alone)
    rnd = np.concatenate([np.zeros(len(roots), np.int64), level[alone] + 1, level[children]])
    key = np.concatenate([roots, alone, children])
    order = (rnd * n_seg + key).argsort(kind="stable")
    of = np.concatenate([np.full(len(roots), -1, np.int64), alone, up])[order]
    child = np.concatenate([roots, np.full(len(alone), -1, np.int64), children])[order]
    rnd = rnd[order]
    is_child = child >= 0
    child = np.maximum(child, 0)
    in_tail = of >= 0
    up = np.maximum(of, 0)
    tails = np.where(in_tail, tail[up], 0)
    owns = np.where(is_child, own[child], 0)
    counts = np.bincount(rnd, minlength=layout.depth + 1)
    first = counts.cumsum() - counts
    local = counting(len(rnd)) - first[rnd]  # each entry's sequence within its round
    run_of = np.full(n_seg, -1, dtype=np.int64)  # shared segment -> its sequence in its level's round
    run_of[child[is_child]] = local[is_child]
    state = run_of[up]
    bounds = counts.cumsum().tolist()
    counts = counts.tolist()
    states = [None] + [state[a:b] for a, b in itertools.pairwise(bounds)]
    # round 0's entries are their own rows in the first piece (no tail in front): as first written
    root = ~in_tail
    tail_start = np.where(root, start[child], tail_begin[up])
    tails = np.where(root, owns, tails)
    own_start = np.where(root, 0, np.where(is_child, start[child], 0))
    owns = np.where(root, 0, owns)
    # the kept pieces tile the compact row: a child's own rows (round 0: its rows), a tail alone's tail;
    # in compact order (zero-length pieces, which may share a start with another, hold no row)
    kept_at = np.where(is_child, start[child], tail_begin[up])
    kept = kept_at.argsort(kind="stable")
    return RoundPieces(
        tail_start=tail_start,
        tails=tails,
        own_start=own_start,
        owns=owns,
        lengths=tails + owns,
        counts=counts,
        states=states,
        kept_len=np.where(is_child, owns + root * tails, tails)[kept],
        kept_seq=kept,
        kept_off=np.where(is_child & ~root, tails, 0)[kept],
    )


def gdn_host_index(layout: Layout, arena: Arena | None = None, pieces: RoundPieces | None = None) -> dict:
    """Host arrays of every round (see `GDNIndex`), written into `arena` when given; uploaded by the plan builder."""
    arena = arena or Arena()
    pieces = pieces or gdn_pieces(layout)
    # Every round's rows, boundaries and chunk tables are built once for all rounds together (the
    # joint call's), and each round's are slices of them, renumbered from the round's first
    # sequence: a handful of array calls however many rounds. Per sequence two pieces, the
    # parent's tail then the child's own rows (round 0: its rows and an empty piece).
    joint = pieces.lengths
    src = arena.ranges(interleave(pieces.tail_start, pieces.own_start), interleave(pieces.tails, pieces.owns))
    cu_joint = arena.boundaries(joint)
    # the kept pieces in compact order: their round rows are the out index
    out = arena.ranges(cu_joint[pieces.kept_seq] + pieces.kept_off, pieces.kept_len)
    host = {"out_index": out, "rounds": len(pieces.counts)}
    chunks_joint = chunk_indices(joint, arena, np.int32)
    offsets_joint = arena.boundaries(-(-joint // CHUNK))
    first_seq = 0
    for r, (n, state) in enumerate(zip(pieces.counts, pieces.states)):
        if not n:
            continue
        s0, s1 = first_seq, first_seq + n
        first_seq = s1
        c0, c1 = int(offsets_joint[s0]), int(offsets_joint[s1])
        host |= {
            f"src{r}": src[cu_joint[s0] : cu_joint[s1]],
            f"cu{r}": np.subtract(cu_joint[s0 : s1 + 1], cu_joint[s0], out=arena.take(n + 1, np.int32)),
            f"chunks{r}": np.subtract(
                chunks_joint[c0:c1], np.array([s0, 0], np.int32), out=arena.take(2 * (c1 - c0), np.int32).reshape(-1, 2)
            ),
            f"offsets{r}": np.subtract(offsets_joint[s0 : s1 + 1], c0, out=arena.take(n + 1, np.int32)),
            f"export{r}": r + 1 < len(pieces.counts),  # not an array: stays on the host
        }
        if state is not None:
            zero = bool((state < 0).any())
            host[f"zero{r}"] = zero
            host[f"state{r}"] = arena.put(np.where(state < 0, 0, state + zero))
    # every round's rows in order: one gather per input serves all rounds (gdn_rounds)
    host |= {"src": src, "cu_joint": cu_joint, "chunks_joint": chunks_joint, "offsets_joint": offsets_joint}
    host["src_identity"] = _is_identity(src, layout.compact_length)
    host["out_identity"] = _is_identity(out, layout.compact_length)
    return host


def _is_identity(index: np.ndarray, length: int) -> bool:
    if len(index) != length:
        return False
    # a plan whose rounds replay a tail, or run segments out of compact order, mostly shows it in the
    # first or last rows, or at every 61st row (rounds move whole segments): looked at first
    head, tail = min(length, 64), max(length - 64, 0)
    every = counting(length)
    return bool(
        (index[:head] == every[:head]).all()
        and (index[tail:] == every[tail:]).all()
        and (index[::61] == every[::61]).all()
        and (index == every).all()
    )


def gdn_index(host: dict, dev: dict) -> GDNIndex:
    """Assemble the index from host arrays and their uploaded device copies."""
    bucketed = host.get("bucketed", False)

    def on_host(cu):
        return None if bucketed else torch.from_numpy(cu)

    rounds = []
    for r in range(host["rounds"]):
        if f"src{r}" not in dev:
            rounds.append(None)
            continue
        rounds.append(
            GDNRound(
                src=dev[f"src{r}"],
                cu_seqlens=dev[f"cu{r}"],
                cu_seqlens_cpu=on_host(host[f"cu{r}"]),
                chunk_indices=dev[f"chunks{r}"],
                chunk_offsets=dev[f"offsets{r}"],
                num_sequences=len(host[f"cu{r}"]) - 1,
                rows=int(host[f"cu{r}"][-1]),
                state_index=dev.get(f"state{r}"),
                zero_state=host.get(f"zero{r}", False),
                export_state=host[f"export{r}"],
            )
        )
    return GDNIndex(
        rounds=tuple(rounds),
        out_index=dev["out_index"],
        src=dev["src"],
        src_identity=host["src_identity"],
        out_identity=host["out_identity"],
        joint=GDNRound(
            src=dev["src"],
            cu_seqlens=dev["cu_joint"],
            cu_seqlens_cpu=on_host(host["cu_joint"]),
            chunk_indices=dev["chunks_joint"],
            chunk_offsets=dev["offsets_joint"],
            num_sequences=len(host["cu_joint"]) - 1,
            rows=int(host["cu_joint"][-1]),
        ),
        bucketed=bucketed,
    )


def check_plan_tables(gdn_fn, kernels, dtype: torch.dtype) -> None:
    """Refuse a graph (a padded plan's layer stack, a scoring forward's layer graph) over a backend that would read
    chunk tables of its own making: fla derives them from `cu_seqlens` and caches them by tensor identity, so a
    replay would read the capture's tables, for another layout of the bucket or after fla's cache freed them.
    Stages that take the plan's tables say `plan_tables`; a backend that derives nothing it keeps (the float64
    reference) says `table_free`."""
    function_for = getattr(gdn_fn, "function_for", None)
    fn = gdn_fn if function_for is None else function_for(dtype)
    if kernels is not None and getattr(kernels, "plan_tables", False):
        return
    if kernels is None and getattr(fn, "table_free", False):
        return
    raise CudaGraphsUnavailable(derived_tables_refused("gated_delta_rule", fn))


def derived_tables_refused(op: str, fn) -> str:
    """Why a graph over `op`'s backend `fn` is refused, and what to do (see `check_plan_tables`)."""
    fix = ("Use the fla backend with its joint rounds (unset PATCHGEN_FLA_JOINT_ROUNDS=0) or the triton backend"
           if op == "gated_delta_rule" else "Use the fla or triton causal_conv1d backend")
    if call_graphs.LAYER_GRAPHS.capturing:
        return (
            f"the {op} backend ({getattr(fn, '__module__', fn)}) derives its chunk tables from cu_seqlens and caches "
            "them by tensor identity (fla), which a scoring forward's layer graph would replay after that cache "
            f"freed them. {fix}, or set PATCHGEN_LAYER_GRAPHS=0"
        )
    return (
        f"shared_prefix_cuda_graphs pads the plan to bucket counts, and the {op} backend "
        f"({getattr(fn, '__module__', fn)}) derives chunk tables from cu_seqlens itself (fla caches them by tensor "
        f"identity: a replay for another layout would read the capture step's tables). {fix}, or set "
        "shared_prefix_cuda_graphs_buckets=False (graphs then key on the exact layout)"
    )


def shared_prefix_gated_delta_rule(
    plan, gdn_fn, q, k, v, g, beta, *, scale: float | None = None, use_qk_l2norm_in_kernel: bool = True
) -> torch.Tensor:
    """Gated DeltaNet over the compact row in one `gdn_fn` call per level (the `gated_delta_rule` slot).

    `q, k: [1, C, H, K]`, `v: [1, C, HV, V]`, `g, beta: [1, C, HV]`; returns `o: [1, C, HV, V]`.
    """
    idx: GDNIndex = plan.gdn
    kernels = round_kernels(gdn_fn, q.dtype)
    if idx.bucketed or call_graphs.LAYER_GRAPHS.capturing:
        check_plan_tables(gdn_fn, kernels, q.dtype)
    inputs = (q, k, v, g, beta)
    if kernels is not None:
        scale = float(k.shape[-1] ** -0.5 if scale is None else scale)
        # a scoring forward on CUDA replays one graph of the rounds per forward; a padded plan is the layer-stack graphs'
        if not idx.bucketed and CALL_GRAPHS.applies(kernels, inputs):
            settings = (kernels, scale, use_qk_l2norm_in_kernel)

            def rounds(*xs):
                return rounds_forward(kernels, idx, scale, use_qk_l2norm_in_kernel, *xs)[0]

            out = CALL_GRAPHS.run("gated_delta_rule", idx, settings, rounds, inputs)
            if out is not None:
                return out
        return gated_delta_rule_rounds(kernels, idx, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    common = {"scale": scale, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel}
    outputs, states, start = [], None, 0
    for r, rnd in enumerate(idx.rounds):
        if rnd is None:
            continue
        if r == 0:
            h0 = None
        elif states is None:  # no round 0: every root is shorter than one chunk
            shape = (rnd.num_sequences, v.shape[2], k.shape[3], v.shape[3])
            h0 = v.new_zeros(shape, dtype=torch.promote_types(v.dtype, torch.float32))
        else:
            if rnd.zero_state:
                states = torch.cat([states.new_zeros((1, *states.shape[1:])), states])
            h0 = states.index_select(0, rnd.state_index)
        rows = slice(start, start + rnd.rows)
        start += rnd.rows
        o, states = gdn_fn(
            *(x[:, rows] if idx.src_identity else x.index_select(1, rnd.src) for x in inputs),
            initial_state=h0,
            output_final_state=rnd.export_state,
            cu_seqlens=rnd.cu_seqlens,
            cu_seqlens_cpu=rnd.cu_seqlens_cpu,
            chunk_indices=rnd.chunk_indices,
            **common,
        )
        outputs.append(o)
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return o if idx.out_identity else o.index_select(1, idx.out_index)
