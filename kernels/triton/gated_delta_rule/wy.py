"""Stage 2: the WY (UT) representation of the delta rule inside one chunk.

Within a chunk with chunk-start state S0 and chunk-local cumulative decay G, the per-token
updates u_i = beta_i (v_i - e^{G_i} S0^T k_i - sum_{j<i} e^{G_i - G_j} (k_i . k_j) u_j) form
a unit-lower-triangular system (I + L) U = diag(beta) V - diag(beta e^G) K S0 with
L_ij = beta_i e^{G_i - G_j} k_i . k_j for j < i. With A = (I + L)^-1:

    U = u - w S0,   u = A diag(beta) V,   w = A diag(beta e^G) K.

The forward stores A (fp32, [T, HV, 64]) for the backward, and w, u in the input dtype.
The backward maps (dw, du) to (dk, dv, dbeta, dG) through dL = -A^T dA A^T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import bwd_tuning, head_block, mm, precision_for
from .transposes import transpose_tuning
from .varlen import Chunking


@triton.jit
def unit_lower_inverse(L, BT: tl.constexpr, LOG2_BT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 for strictly-lower L by block doubling: at block size s, with D the inverse of
    the s-blocks, the 2s-block inverse is D - D L_off D (L_off: L's lower-left s x s sub-blocks).
    Exact block triangular inversion, no power series, so no cancellation."""
    o = tl.arange(0, BT)
    r = o[:, None]
    c = o[None, :]
    inv = tl.where(r == c, 1.0, 0.0).to(ACC)
    for lvl in tl.static_range(LOG2_BT):
        s = 1 << lvl
        off = ((r // (2 * s)) == (c // (2 * s))) & ((r // s) > (c // s))
        l_off = tl.where(off, L, 0.0)
        inv = inv - mm(mm(inv, l_off, ACC, PREC, ACC), inv, ACC, PREC, ACC)
    return inv


@triton.jit
def wy_fwd_kernel(k, v, beta, gc, A, w, u, cu_seqlens, chunk_indices,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, LOG2_BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr):
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i_t = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    o_t = tl.arange(0, BT)
    rows = (bos + i_t * BT + o_t).to(tl.int64)
    m_t = rows < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    kk = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    kT = tl.load(k + (rows[None, :] * H + i_h) * K + o_k[:, None], mask=m_t[None, :] & m_k[:, None], other=0.0)
    b = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    G = tl.load(gc + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)

    # rows past the end load G = 0, where G_i - G_j could overflow exp: both rows must be real
    lower = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    decay = tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0))
    L = tl.where(lower, b[:, None] * decay * mm(kk, kT, DOT, PREC, ACC), 0.0)
    Ainv = unit_lower_inverse(L, BT, LOG2_BT, ACC, SOLVE_PREC)
    tl.store(A + (rows[:, None] * HV + i_hv) * BT + o_t[None, :], Ainv.to(A.dtype.element_ty), mask=m_t[:, None])

    kb = kk.to(ACC) * (b * tl.exp(G))[:, None]
    ww = mm(Ainv, kb, DOT, PREC, ACC)
    tl.store(w + (rows[:, None] * HV + i_hv) * K + o_k[None, :], ww.to(w.dtype.element_ty),
             mask=m_t[:, None] & m_k[None, :])
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m = m_t[:, None] & (o_v < V)[None, :]
        vv = tl.load(v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m, other=0.0).to(ACC)
        uu = mm(Ainv, vv * b[:, None], DOT, PREC, ACC)
        tl.store(u + (rows[:, None] * HV + i_hv) * V + o_v[None, :], uu.to(u.dtype.element_ty), mask=m)


@triton.jit
def wy_bwd_kernel(k, v, beta, gc, A, dw, du, dk, dk_out, dv, dbeta, dg, cu_seqlens, chunk_indices,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  ACC: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
                  ACCUMULATE: tl.constexpr, TRANS: tl.constexpr):
    """dk, dg are per value head ([T, HV, K], [T, HV]); with ACCUMULATE they are added to. dk's result
    goes to dk_out (dk itself, or a tensor of another dtype).

    TRANS: every transposed tile is `tl.trans` of its tile (A, k, v, dA, dL, dKK loaded or computed
    once); else the transposes are loaded or computed as products of their own (the first design)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // (HV // H)
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

    kk = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
    b = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    G = tl.load(gc + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    eG = tl.exp(G)
    a_offs = (rows[:, None] * HV + i_hv) * BT + o_t[None, :]
    Am = tl.load(A + a_offs, mask=m_t[:, None], other=0.0).to(ACC)
    dww = tl.load(dw + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=m_tk, other=0.0).to(ACC)
    if TRANS:
        kT = tl.trans(kk)
        AT = tl.trans(Am)
    else:
        kT = tl.load(k + (rows[None, :] * H + i_h) * K + o_k[:, None], mask=m_kt, other=0.0).to(ACC)
        aT_offs = (rows[None, :] * HV + i_hv) * BT + o_t[:, None]
        AT = tl.load(A + aT_offs, mask=m_t[None, :], other=0.0).to(ACC)

    # w = A kb with kb = diag(beta e^G) K
    kb_scale = b * eG
    dA = mm(dww, kT * kb_scale[None, :], DOT, PREC, ACC)
    if not TRANS:
        dwT = tl.load(dw + (rows[None, :] * HV + i_hv) * K + o_k[:, None], mask=m_kt, other=0.0).to(ACC)
        dAT = mm(kk * kb_scale[:, None], dwT, DOT, PREC, ACC)
    dkb = mm(AT, dww, DOT, PREC, ACC)
    dkk = dkb * kb_scale[:, None]
    t = tl.sum(kk * dkb, axis=1)
    db = eG * t
    dG = kb_scale * t

    # u = A vb with vb = diag(beta) V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_vt = m_v[:, None] & m_t[None, :]
        v_offs = (rows[:, None] * HV + i_hv) * V + o_v[None, :]
        vv = tl.load(v + v_offs, mask=m_tv, other=0.0).to(ACC)
        duu = tl.load(du + v_offs, mask=m_tv, other=0.0).to(ACC)
        if TRANS:
            dA += mm(duu, tl.trans(vv * b[:, None]), DOT, PREC, ACC)
        else:
            vT_offs = (rows[None, :] * HV + i_hv) * V + o_v[:, None]
            vT = tl.load(v + vT_offs, mask=m_vt, other=0.0).to(ACC)
            duT = tl.load(du + vT_offs, mask=m_vt, other=0.0).to(ACC)
            dA += mm(duu, vT * b[None, :], DOT, PREC, ACC)
            dAT += mm(vv * b[:, None], duT, DOT, PREC, ACC)
        dvb = mm(AT, duu, DOT, PREC, ACC)
        tl.store(dv + v_offs, (dvb * b[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        db += tl.sum(vv * dvb, axis=1)

    # A = (I + L)^-1  =>  dL = -A^T dA A^T (kept strictly lower); its transpose likewise.
    real = m_t[:, None] & m_t[None, :]  # rows past the end load G = 0: keep them out of every exp
    lower = (o_t[:, None] > o_t[None, :]) & real
    upper = (o_t[:, None] < o_t[None, :]) & real
    dL = tl.where(lower, -mm(mm(AT, dA, ACC, SOLVE_PREC, ACC), AT, ACC, SOLVE_PREC, ACC), 0.0)
    E = tl.where(lower, tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)
    KK = mm(kk, kT, DOT, PREC, ACC)
    dKK = dL * b[:, None] * E
    if TRANS:  # L = b E (K K^T) below the diagonal: dK = (dKK + dKK^T) K
        dkk += mm(dKK + tl.trans(dKK), kk, DOT, PREC, ACC)
    else:
        dLT = tl.where(upper, -mm(mm(Am, dAT, ACC, SOLVE_PREC, ACC), Am, ACC, SOLVE_PREC, ACC), 0.0)
        ET = tl.where(upper, tl.exp(tl.where(upper, G[None, :] - G[:, None], 0.0)), 0.0)
        dKKT = dLT * b[None, :] * ET
        dkk += mm(dKK, kk, DOT, PREC, ACC) + mm(dKKT, kk, DOT, PREC, ACC)
    db += tl.sum(dL * E * KK, axis=1)
    R = dKK * KK
    dG += tl.sum(R, axis=1) - tl.sum(R, axis=0)

    dk_offs = (rows[:, None] * HV + i_hv) * K + o_k[None, :]
    if ACCUMULATE:
        dkk += tl.load(dk + dk_offs, mask=m_tk, other=0.0).to(ACC)
        dG += tl.load(dg + rows * HV + i_hv, mask=m_t, other=0.0).to(ACC)
    tl.store(dk_out + dk_offs, dkk.to(dk_out.dtype.element_ty), mask=m_tk)
    tl.store(dbeta + rows * HV + i_hv, db.to(dbeta.dtype.element_ty), mask=m_t)
    tl.store(dg + rows * HV + i_hv, dG.to(dg.dtype.element_ty), mask=m_t)


def _bv(v: int, dtype, block_v: int | None) -> int:
    return block_v or head_block(v, dtype, cap=64)


def wy_fwd(k, v, beta, gc, chunking: Chunking, *, block_v: int | None = None):
    """k: [T, H, K], v: [T, HV, V], beta, gc: [T, HV]. Returns (A [T, HV, BT] fp32, w [T, HV, K], u [T, HV, V])."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    prec = precision_for(k.dtype)
    BT = chunking.chunk_size
    A = torch.empty(T, HV, BT, dtype=prec.acc_torch, device=k.device)
    w = torch.empty(T, HV, K, dtype=k.dtype, device=k.device)
    u = torch.empty(T, HV, V, dtype=v.dtype, device=k.device)
    wy_fwd_kernel[(chunking.num_chunks, HV)](
        k, v, beta, gc, A, w, u, chunking.cu_seqlens, chunking.chunk_indices,
        H=H, HV=HV, K=K, V=V, BT=BT, LOG2_BT=BT.bit_length() - 1, BK=head_block(K, k.dtype), BV=_bv(V, k.dtype, block_v),
        ACC=prec.acc, DOT=prec.dot, PREC=prec.dot_precision, SOLVE_PREC=prec.solve_precision, num_warps=4)
    return A, w, u


def wy_bwd(k, v, beta, gc, A, dw, du, chunking: Chunking, *, dk=None, dg=None, block_v: int | None = None,
           trans: bool | None = None, dk_dtype: torch.dtype | None = None):
    """Gradients of (w, u) = wy(k, v, beta, G). Returns (dk per value head [T, HV, K], dv, dbeta, dG).

    When dk and dg (fp32, per value head) are given, the results are added into them in place; dk_dtype
    (other than fp32) puts dk's sum into a new tensor of that dtype instead (dk is then only read).
    trans: the `tl.trans` design (None: as `transposes.transpose_tuning(device)` says).
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    prec = precision_for(k.dtype)
    accumulate = dk is not None
    if dk is None:
        dk = torch.empty(T, HV, K, dtype=prec.acc_torch, device=k.device)
        dg = torch.empty(T, HV, dtype=prec.acc_torch, device=k.device)
    dk_out = dk if dk_dtype in (None, dk.dtype) else torch.empty_like(dk, dtype=dk_dtype)
    dv = torch.empty_like(v)
    dbeta = torch.empty(T, HV, dtype=prec.acc_torch, device=k.device)
    tuning = bwd_tuning(k.dtype)
    wy_bwd_kernel[(chunking.num_chunks, HV)](
        k, v, beta, gc, A, dw, du, dk, dk_out, dv, dbeta, dg, chunking.cu_seqlens, chunking.chunk_indices,
        H=H, HV=HV, K=K, V=V, BT=chunking.chunk_size, BK=head_block(K, k.dtype), BV=_bv(V, k.dtype, block_v or tuning["block_v"]),
        ACC=prec.acc, DOT=prec.dot, PREC=prec.dot_precision, SOLVE_PREC=prec.solve_precision,
        ACCUMULATE=accumulate, TRANS=transpose_tuning(k.device).wy_bwd if trans is None else trans,
        num_warps=8, num_stages=tuning["num_stages"])
    return dk_out, dv, dbeta, dg
