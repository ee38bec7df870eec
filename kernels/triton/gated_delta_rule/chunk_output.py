"""Stage 4: the chunk outputs, and the backward of everything outside the WY stage.

Forward, per chunk with start state S (h), true updates U (v_new) and causal decay matrix
D_ij = e^{G_i - G_j} [i >= j]:
    O = scale (diag(e^G) Q S + ((Q K^T) * D) U)
Backward (given dO, dU from the state backward, the chunk-end gradient dS from dh):
    dQ = scale (diag(e^G) dO S^T + dP K),     dP = (dO U^T) * D
    dK = scale dP^T Q + diag(e^{G_last - G}) U dS^T
    dw = -dU S^T
    dG from every e^G factor (output, D, the state update's e^{G_last} and e^{G_last - G}).
dq, dk and dG come out per value head (fp32); the caller sums value heads onto key heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import bwd_tuning, head_block, mm, precision_for, scale_arg
from .transposes import transpose_tuning
from .varlen import Chunking


@triton.jit
def chunk_output_fwd_kernel(q, k, gc, h, v_new, o, cu_seqlens, chunk_indices, scale_ptr,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_hv = tl.program_id(2)
    i_h = i_hv // (HV // H)
    scale = tl.load(scale_ptr).to(ACC)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i_t = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    o_t = tl.arange(0, BT)
    rows = (bos + i_t * BT + o_t).to(tl.int64)
    m_t = rows < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]

    qq = tl.load(q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    kT = tl.load(k + (rows[None, :] * H + i_h) * K + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
    G = tl.load(gc + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    S = tl.load(h + (i_c * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                mask=m_k[:, None] & m_v[None, :], other=0.0)
    U = tl.load(v_new + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_tv, other=0.0)

    # rows past the end load G = 0, where G_i - G_j could overflow exp: both rows must be real
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    P = mm(qq, kT, DOT, PREC, ACC)
    P = tl.where(causal, P * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
    out = mm(qq, S, DOT, PREC, ACC) * tl.exp(G)[:, None] + mm(P, U, DOT, PREC, ACC)
    tl.store(o + (rows[:, None] * HV + i_hv) * V + o_v[None, :], (scale * out).to(o.dtype.element_ty), mask=m_tv)


@triton.jit
def chunk_output_bwd_kernel(q, k, gc, h, dh, v_new, do, du, dq, dk, dw, dg, cu_seqlens, chunk_indices, scale_ptr,
                            H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, TRANS: tl.constexpr):
    """TRANS: the gradient of K Q^T is `tl.trans` of that of Q K^T (no dO^T, U^T reloads, no U dO^T
    product); else computed on its own (the first design)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    scale = tl.load(scale_ptr).to(ACC)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i_t = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    o_t = tl.arange(0, BT)
    rows = (bos + i_t * BT + o_t).to(tl.int64)
    m_t = rows < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    m_kt = m_k[:, None] & m_t[None, :]
    h_base = (i_c * HV + i_hv).to(tl.int64) * K * V

    dq_state = tl.zeros([BT, BK], dtype=ACC)   # dO S^T
    dk_state = tl.zeros([BT, BK], dtype=ACC)   # U dS^T
    dww = tl.zeros([BT, BK], dtype=ACC)        # -dU S^T
    dP = tl.zeros([BT, BT], dtype=ACC)         # dO U^T
    dPT = tl.zeros([BT, BT], dtype=ACC)        # U dO^T
    s_ds = tl.zeros([BK], dtype=ACC)           # <S, dS> by rows of S
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_vt = m_v[:, None] & m_t[None, :]
        m_vk = m_v[:, None] & m_k[None, :]
        t_offs = (rows[:, None] * HV + i_hv) * V + o_v[None, :]
        tT_offs = (rows[None, :] * HV + i_hv) * V + o_v[:, None]
        sT_offs = h_base + o_k[None, :] * V + o_v[:, None]
        doo = tl.load(do + t_offs, mask=m_tv, other=0.0)
        U = tl.load(v_new + t_offs, mask=m_tv, other=0.0)
        duu = tl.load(du + t_offs, mask=m_tv, other=0.0)
        ST = tl.load(h + sT_offs, mask=m_vk, other=0.0)
        dST = tl.load(dh + sT_offs, mask=m_vk, other=0.0)
        dq_state += mm(doo, ST, DOT, PREC, ACC)
        dk_state += mm(U, dST, DOT, PREC, ACC)
        dww -= mm(duu, ST, DOT, PREC, ACC)
        if TRANS:
            dP += mm(doo, tl.trans(U), DOT, PREC, ACC)
        else:
            doT = tl.load(do + tT_offs, mask=m_vt, other=0.0)
            UT = tl.load(v_new + tT_offs, mask=m_vt, other=0.0)
            dP += mm(doo, UT, DOT, PREC, ACC)
            dPT += mm(U, doT, DOT, PREC, ACC)
        s_ds += tl.sum(ST.to(ACC) * dST.to(ACC), axis=0)

    qq = tl.load(q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
    kk = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
    kT = tl.load(k + (rows[None, :] * H + i_h) * K + o_k[:, None], mask=m_kt, other=0.0).to(ACC)
    G = tl.load(gc + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
    G_last = tl.load(gc + last.to(tl.int64) * HV + i_hv).to(ACC)

    real = m_t[:, None] & m_t[None, :]  # rows past the end load G = 0: keep them out of every exp
    causal = (o_t[:, None] >= o_t[None, :]) & real
    causal_t = (o_t[:, None] <= o_t[None, :]) & real
    D = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
    dS = scale * dP * D        # gradient of Q K^T
    if TRANS:
        dST = tl.trans(dS)
    else:  # its transpose, computed rather than transposed
        DT = tl.where(causal_t, tl.exp(tl.where(causal_t, G[None, :] - G[:, None], 0.0)), 0.0)
        dST = scale * dPT * DT

    dq_out = dq_state * (scale * tl.exp(G))[:, None]
    dqq = dq_out + mm(dS, kk, DOT, PREC, ACC)
    k_decay = tl.exp(G_last - G)
    dkk = mm(dST, qq, DOT, PREC, ACC) + dk_state * k_decay[:, None]

    QK = mm(qq, kT, DOT, PREC, ACC)
    R = dS * QK
    r_state = tl.sum(kk * dk_state, axis=1) * k_decay
    dG = tl.sum(dq_out * qq, axis=1) + tl.sum(R, axis=1) - tl.sum(R, axis=0) - r_state
    dG_last = tl.sum(r_state, axis=0) + tl.exp(G_last) * tl.sum(s_ds, axis=0)
    dG += tl.where(rows == last, dG_last, 0.0)

    t_offs = (rows[:, None] * HV + i_hv) * K + o_k[None, :]
    tl.store(dq + t_offs, dqq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + t_offs, dkk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dw + t_offs, dww.to(dw.dtype.element_ty), mask=m_tk)
    tl.store(dg + rows * HV + i_hv, dG.to(dg.dtype.element_ty), mask=m_t)


def _bv(v: int, dtype, block_v: int | None) -> int:
    return block_v or head_block(v, dtype, cap=64)


def chunk_output_fwd(q, k, gc, h, v_new, scale, chunking: Chunking, *, out_dtype=None, block_v: int | None = None,
                     out=None):
    """Returns o [T, HV, V] in `out_dtype` (v_new's dtype by default), written into `out` when given
    (contiguous rows of a larger buffer: the joint GDN rounds)."""
    T, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    prec = precision_for(q.dtype)
    o = torch.empty(T, HV, V, dtype=out_dtype or v_new.dtype, device=q.device) if out is None else out
    BV = _bv(V, q.dtype, block_v)
    chunk_output_fwd_kernel[(triton.cdiv(V, BV), chunking.num_chunks, HV)](
        q, k, gc, h, v_new, o, chunking.cu_seqlens, chunking.chunk_indices, scale_arg(scale, prec, q.device),
        H=H, HV=HV, K=K, V=V, BT=chunking.chunk_size, BK=head_block(K, q.dtype), BV=BV,
        ACC=prec.acc, DOT=prec.dot, PREC=prec.dot_precision, num_warps=4)
    return o


def chunk_output_bwd(q, k, gc, h, dh, v_new, do, du, scale, chunking: Chunking, *, block_v: int | None = None,
                     trans: bool | None = None, dq_dtype: torch.dtype | None = None, out=None):
    """Returns (dq, dk, dw [T, HV, K], dG [T, HV]), per value head, fp32 (dq in `dq_dtype` when given),
    written into `out` (four such tensors) when given.
    trans: the `tl.trans` design (None: as `transposes.transpose_tuning(device)` says)."""
    T, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    prec = precision_for(q.dtype)
    if out is None:
        dk = torch.empty(T, HV, K, dtype=prec.acc_torch, device=q.device)
        dq = torch.empty_like(dk, dtype=dq_dtype or prec.acc_torch)
        dw = torch.empty_like(dk)
        dg = torch.empty(T, HV, dtype=prec.acc_torch, device=q.device)
    else:
        dq, dk, dw, dg = out
        if dq_dtype is not None and dq.dtype != dq_dtype:
            raise ValueError(f"chunk_output_bwd: out's dq is {dq.dtype}, but dq_dtype={dq_dtype} was asked for")
    tuning = bwd_tuning(q.dtype)
    chunk_output_bwd_kernel[(chunking.num_chunks, HV)](
        q, k, gc, h, dh, v_new, do, du, dq, dk, dw, dg, chunking.cu_seqlens, chunking.chunk_indices, scale_arg(scale, prec, q.device),
        H=H, HV=HV, K=K, V=V, BT=chunking.chunk_size, BK=head_block(K, q.dtype), BV=_bv(V, q.dtype, block_v or tuning["block_v"]),
        ACC=prec.acc, DOT=prec.dot, PREC=prec.dot_precision,
        TRANS=transpose_tuning(q.device).output_bwd if trans is None else trans,
        num_warps=8, num_stages=tuning["num_stages"])
    return dq, dk, dw, dg
