"""Stage 3: the inter-chunk state recurrence, sequential over the chunks of each sequence.

Forward, per chunk with start state S (stored as h, [NT, HV, K, V]):
    U = u - w S                                   (v_new: the chunk's true delta-rule updates)
    S <- e^{G_last} S + (diag(e^{G_last - G}) K)^T U
Backward, reverse over chunks, with dS the gradient of the chunk's end state (stored as dh):
    dU  = scale (P^T dO) + diag(e^{G_last - G}) K dS,   P = (Q K^T) * e^{G_i - G_j} [i >= j]
    dS <- e^{G_last} dS + scale (diag(e^G) Q)^T dO - w^T dU
One program per (block of V columns, sequence, value head); the state tile is [K, BV] in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._common import bwd_tuning, head_block, mm, precision_for, scale_arg
from .varlen import Chunking


@triton.jit
def chunk_state_fwd_kernel(k, w, u, gc, h, v_new, h0, ht, cu_seqlens, chunk_offsets,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                           ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    n_chunks = tl.cdiv(eos - bos, BT)
    first_chunk = tl.load(chunk_offsets + i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_offs = o_k[:, None] * V + o_v[None, :]

    state = tl.zeros([BK, BV], dtype=ACC)
    if HAS_H0:
        state += tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + s_offs, mask=m_kv, other=0.0).to(ACC)
    for i_t in range(n_chunks):
        h_base = ((first_chunk + i_t) * HV + i_hv).to(tl.int64) * K * V
        tl.store(h + h_base + s_offs, state.to(h.dtype.element_ty), mask=m_kv)
        rows = (bos + i_t * BT + o_t).to(tl.int64)
        m_t = rows < eos
        ww = tl.load(w + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        uu = tl.load(u + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                     other=0.0).to(ACC)
        vn = uu - mm(ww, state, DOT, PREC, ACC)
        tl.store(v_new + (rows[:, None] * HV + i_hv) * V + o_v[None, :], vn.to(v_new.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        G = tl.load(gc + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)
        last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
        G_last = tl.load(gc + last.to(tl.int64) * HV + i_hv).to(ACC)
        kT = tl.load(k + (rows[None, :] * H + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :],
                     other=0.0).to(ACC)
        kT = kT * tl.exp(G_last - G)[None, :]
        state = state * tl.exp(G_last) + mm(kT, vn, DOT, PREC, ACC)
    if STORE_HT:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + s_offs, state.to(ht.dtype.element_ty), mask=m_kv)


@triton.jit
def chunk_state_bwd_kernel(q, k, w, gc, do, dh, du, dht, dh0, cu_seqlens, chunk_offsets, scale_ptr,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                           ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    n_chunks = tl.cdiv(eos - bos, BT)
    first_chunk = tl.load(chunk_offsets + i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_offs = o_k[:, None] * V + o_v[None, :]
    scale = tl.load(scale_ptr).to(ACC)
    # causal, transposed: entry (j, i) is P_ij, nonzero for i >= j
    causal_t = o_t[None, :] >= o_t[:, None]

    dstate = tl.zeros([BK, BV], dtype=ACC)
    if HAS_DHT:
        dstate += tl.load(dht + (i_n * HV + i_hv).to(tl.int64) * K * V + s_offs, mask=m_kv, other=0.0).to(ACC)
    for j in range(n_chunks):
        i_t = n_chunks - 1 - j
        h_base = ((first_chunk + i_t) * HV + i_hv).to(tl.int64) * K * V
        tl.store(dh + h_base + s_offs, dstate.to(dh.dtype.element_ty), mask=m_kv)
        rows = (bos + i_t * BT + o_t).to(tl.int64)
        m_t = rows < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_kt = m_k[:, None] & m_t[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        G = tl.load(gc + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)
        last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
        G_last = tl.load(gc + last.to(tl.int64) * HV + i_hv).to(ACC)
        kk = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
        qT = tl.load(q + (rows[None, :] * H + i_h) * K + o_k[:, None], mask=m_kt, other=0.0).to(ACC)
        wT = tl.load(w + (rows[None, :] * HV + i_hv) * K + o_k[:, None], mask=m_kt, other=0.0)
        doo = tl.load(do + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_tv, other=0.0)
        PT = mm(kk, qT, DOT, PREC, ACC)
        live = causal_t & m_t[:, None] & m_t[None, :]  # rows past the end load G = 0: out of every exp
        PT = tl.where(live, PT * tl.exp(tl.where(live, G[None, :] - G[:, None], 0.0)), 0.0)
        kd = kk * tl.exp(G_last - G)[:, None]
        duu = scale * mm(PT, doo, DOT, PREC, ACC) + mm(kd, dstate, DOT, PREC, ACC)
        tl.store(du + (rows[:, None] * HV + i_hv) * V + o_v[None, :], duu.to(du.dtype.element_ty), mask=m_tv)
        qTg = qT * (scale * tl.exp(G))[None, :]
        dstate = dstate * tl.exp(G_last) + mm(qTg, doo, DOT, PREC, ACC) - mm(wT, duu, DOT, PREC, ACC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * HV + i_hv).to(tl.int64) * K * V + s_offs, dstate.to(dh0.dtype.element_ty), mask=m_kv)


@dataclass
class StateTuning:
    """Launch options of the sequential state kernels (the bench sweeps them; docs/triton_kernels.md
    says what was measured). block_v None: the caller's block_v, else 64 (32 for wide dtypes' backward)."""

    fwd_block_v: int | None = None
    fwd_warps: int = 4
    bwd_block_v: int | None = None
    bwd_warps: int = 8


TUNING = StateTuning()


def _bv(v: int, dtype, block_v: int | None) -> int:
    return block_v or head_block(v, dtype, cap=64)


def _fwd_stages(dtype) -> dict:
    """fp64 tiles pipelined at head dim 128 need 394 KB of shared memory a block, over sm_90's 227 KiB
    (tests/triton/compile_kernels.py --stage llir): 8-byte dtypes are not pipelined."""
    return {"num_stages": 1} if torch.empty((), dtype=dtype).element_size() >= 8 else {}


def chunk_state_fwd(k, w, u, gc, chunking: Chunking, *, initial_state=None, output_final_state=False,
                    block_v: int | None = None):
    """Returns (h [NT, HV, K, V] chunk-start states in k's dtype, v_new [T, HV, V], final [N, HV, K, V] or None)."""
    _T, H, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    prec = precision_for(k.dtype)
    N = chunking.num_seqs
    h = torch.empty(chunking.num_chunks, HV, K, V, dtype=k.dtype, device=k.device)
    v_new = torch.empty_like(u)
    final = torch.empty(N, HV, K, V, dtype=prec.acc_torch, device=k.device) if output_final_state else None
    BV = _bv(V, k.dtype, block_v or TUNING.fwd_block_v)
    chunk_state_fwd_kernel[(triton.cdiv(V, BV), N * HV)](
        k, w, u, gc, h, v_new, initial_state, final, chunking.cu_seqlens, chunking.chunk_offsets,
        H=H, HV=HV, K=K, V=V, BT=chunking.chunk_size, BK=head_block(K, k.dtype), BV=BV,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state,
        ACC=prec.acc, DOT=prec.dot, PREC=prec.dot_precision, num_warps=TUNING.fwd_warps,
        **_fwd_stages(k.dtype))
    return h, v_new, final


def chunk_state_bwd(q, k, w, gc, do, scale, chunking: Chunking, *, dht=None, need_dh0=False,
                    block_v: int | None = None, du=None):
    """Returns (dh [NT, HV, K, V] gradients of the chunk-end states, du [T, HV, V] fp32, dh0 or None);
    du is written into `du` when given."""
    T, H, K = k.shape
    HV, V = do.shape[1], do.shape[2]
    prec = precision_for(k.dtype)
    N = chunking.num_seqs
    dh = torch.empty(chunking.num_chunks, HV, K, V, dtype=k.dtype, device=k.device)
    if du is None:
        du = torch.empty(T, HV, V, dtype=prec.acc_torch, device=k.device)
    dh0 = torch.empty(N, HV, K, V, dtype=prec.acc_torch, device=k.device) if need_dh0 else None
    tuning = bwd_tuning(k.dtype)
    tuned = min(TUNING.bwd_block_v, tuning["block_v"]) if TUNING.bwd_block_v else None  # wide dtypes stay narrow
    BV = _bv(V, k.dtype, block_v or tuned or tuning["block_v"])
    chunk_state_bwd_kernel[(triton.cdiv(V, BV), N * HV)](
        q, k, w, gc, do, dh, du, dht, dh0, chunking.cu_seqlens, chunking.chunk_offsets, scale_arg(scale, prec, k.device),
        H=H, HV=HV, K=K, V=V, BT=chunking.chunk_size, BK=head_block(K, k.dtype), BV=BV,
        HAS_DHT=dht is not None, STORE_DH0=need_dh0,
        ACC=prec.acc, DOT=prec.dot, PREC=prec.dot_precision, num_warps=TUNING.bwd_warps,
        num_stages=tuning["num_stages"])
    return dh, du, dh0
