"""Gated DeltaNet on the compact row: the chunk-aligned two-round split.

Per group with prefix `P`, `B = floor(P / 64) * 64`. Round A runs `prefix[0:B)` from zero state and
exports `S_B`. Round B, one varlen call, runs `tail = prefix[B:P)` alone (its outputs are the
tail's) and `tail + suffix_i` for every member, all from `S_B`; the replayed tail outputs inside the
member sequences are dropped. Exporting only at multiples of 64 keeps the chunk partition of
every member identical to packed execution, which is what makes the split bit-identical with a
chunked kernel (exporting at `P` shifts the chunks and is not). Singletons run whole in round A.
Gradients reach the prefix through `S_B`: the backend must return `dh0` for round B and accept
`dht` for round A.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout import GroupBlock, Layout, boundaries, ranges

CHUNK = 64  # chunk size of the chunked GDN kernels (fla, ours); the split aligns to it


@dataclass(frozen=True, eq=False)
class GDNRound:
    """One varlen call: rows gathered from the compact row, their boundaries and chunk indices."""

    src: torch.Tensor  # [rows] compact row of each input row
    cu_seqlens: torch.Tensor  # [n + 1] int32, on the device
    cu_seqlens_cpu: torch.Tensor  # the same on the host, so a backend never copies it back
    chunk_indices: torch.Tensor  # [chunks, 2] int32: (sequence, chunk within it), fla's layout
    num_sequences: int


@dataclass(frozen=True, eq=False)
class GDNIndex:
    round_a: GDNRound | None  # None when no group has P >= 64 and there is no singleton
    round_b: GDNRound
    state_index: torch.Tensor  # [round B sequences] row of round A's states (shifted by 1 if zero_state)
    zero_state: bool  # some round-B sequence starts from zeros (a group with P < 64)
    out_index: torch.Tensor  # [C] row of cat(round A outputs, round B outputs) for each compact row


def chunk_indices(lengths) -> np.ndarray:
    """[chunks, 2]: (sequence, chunk within it) for chunks of 64, flash-linear-attention's layout."""
    counts = -(-np.asarray(lengths, dtype=np.int64) // CHUNK)
    seq = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    within = ranges(np.zeros(len(lengths), dtype=np.int64), counts)
    return np.stack([seq, within], axis=1)


def gdn_host_index(layout: Layout) -> dict:
    """Host arrays of the two rounds (see `GDNIndex`); uploaded by the plan builder."""
    out = np.empty(layout.compact_length, dtype=np.int64)
    a_starts, a_lengths, a_seq_of_block = [], [], {}
    row = 0
    for bi, blk in enumerate(layout.blocks):
        if isinstance(blk, GroupBlock):
            start, n = blk.prefix_start, (blk.prefix_length // CHUNK) * CHUNK
        else:
            start, n = blk.start, blk.length
        if n > 0:
            a_seq_of_block[bi] = len(a_starts)
            a_starts.append(start)
            a_lengths.append(n)
            out[start : start + n] = np.arange(row, row + n)
            row += n

    b_starts, b_lengths, b_seq_lengths, b_state = [], [], [], []
    for bi, blk in enumerate(layout.blocks):
        if not isinstance(blk, GroupBlock):
            continue
        p = blk.prefix_length
        cut = (p // CHUNK) * CHUNK
        tail_start, tail = blk.prefix_start + cut, p - cut
        state = a_seq_of_block.get(bi)
        if tail > 0:  # the tail alone; its outputs are the prefix tail's
            b_starts.append(tail_start)
            b_lengths.append(tail)
            b_seq_lengths.append(tail)
            b_state.append(state)
            out[tail_start : tail_start + tail] = np.arange(row, row + tail)
            row += tail
        for s_start, r in zip(blk.suffix_starts, blk.suffix_lengths):
            b_starts += [tail_start, s_start]
            b_lengths += [tail, r]
            b_seq_lengths.append(tail + r)
            b_state.append(state)
            out[s_start : s_start + r] = np.arange(row + tail, row + tail + r)
            row += tail + r

    zero_state = any(s is None for s in b_state)
    shift = 1 if zero_state else 0
    state_index = np.asarray([0 if s is None else s + shift for s in b_state], dtype=np.int64)
    host = {
        "zero_state": zero_state,  # not an array: stays on the host
        "out_index": out,
        "state_index": state_index,
        "b_src": ranges(b_starts, b_lengths),
        "b_cu": boundaries(b_seq_lengths).astype(np.int32),
        "b_chunks": chunk_indices(b_seq_lengths).astype(np.int32),
    }
    if a_starts:
        host |= {
            "a_src": ranges(a_starts, a_lengths),
            "a_cu": boundaries(a_lengths).astype(np.int32),
            "a_chunks": chunk_indices(a_lengths).astype(np.int32),
        }
    return host


def gdn_index(host: dict, dev: dict) -> GDNIndex:
    """Assemble the index from host arrays and their uploaded device copies."""

    def round_of(prefix: str) -> GDNRound | None:
        if f"{prefix}_src" not in dev:
            return None
        return GDNRound(
            src=dev[f"{prefix}_src"],
            cu_seqlens=dev[f"{prefix}_cu"],
            cu_seqlens_cpu=torch.from_numpy(host[f"{prefix}_cu"]),
            chunk_indices=dev[f"{prefix}_chunks"],
            num_sequences=len(host[f"{prefix}_cu"]) - 1,
        )

    return GDNIndex(
        round_a=round_of("a"),
        round_b=round_of("b"),
        state_index=dev["state_index"],
        zero_state=host["zero_state"],
        out_index=dev["out_index"],
    )


def shared_prefix_gated_delta_rule(
    plan, gdn_fn, q, k, v, g, beta, *, scale: float | None = None, use_qk_l2norm_in_kernel: bool = True
) -> torch.Tensor:
    """Gated DeltaNet over the compact row in exactly two `gdn_fn` calls (the `gated_delta_rule` slot).

    `q, k: [1, C, H, K]`, `v: [1, C, HV, V]`, `g, beta: [1, C, HV]`; returns `o: [1, C, HV, V]`.
    """
    idx: GDNIndex = plan.gdn
    inputs = (q, k, v, g, beta)
    common = {"scale": scale, "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel}
    if idx.round_a is not None:
        a = idx.round_a
        o_a, states = gdn_fn(
            *(x.index_select(1, a.src) for x in inputs),
            initial_state=None,
            output_final_state=True,
            cu_seqlens=a.cu_seqlens,
            cu_seqlens_cpu=a.cu_seqlens_cpu,
            chunk_indices=a.chunk_indices,
            **common,
        )
        if idx.zero_state:
            states = torch.cat([states.new_zeros((1, *states.shape[1:])), states])
        h0 = states.index_select(0, idx.state_index)
    else:
        o_a = None
        shape = (idx.round_b.num_sequences, v.shape[2], k.shape[3], v.shape[3])
        h0 = v.new_zeros(shape, dtype=torch.promote_types(v.dtype, torch.float32))
    b = idx.round_b
    o_b, _ = gdn_fn(
        *(x.index_select(1, b.src) for x in inputs),
        initial_state=h0,
        output_final_state=False,
        cu_seqlens=b.cu_seqlens,
        cu_seqlens_cpu=b.cu_seqlens_cpu,
        chunk_indices=b.chunk_indices,
        **common,
    )
    o = o_b if o_a is None else torch.cat([o_a, o_b], dim=1)
    return o.index_select(1, idx.out_index)
