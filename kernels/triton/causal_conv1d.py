"""Depthwise causal conv1d over one packed row, varlen, optional SiLU; forward and backward.

y[t, d] = act(bias[d] + sum_w weight[d, w] * x[t - (W-1) + w, d]), where rows before the start
of t's sequence read as zero (every sequence starts from a zero state). W is a kernel parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import next_pow2, precision_for

_ACTIVATIONS = {None: False, "identity": False, "silu": True, "swish": True}


@triton.jit
def causal_conv1d_fwd_kernel(x, weight, bias, y, seq_start, T, D: tl.constexpr, W: tl.constexpr,
                             BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                             ACC: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    start = tl.load(seq_start + o_t, mask=m_t, other=0)
    acc = tl.zeros([BT, BD], dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(ACC)[None, :]
    for w in tl.static_range(W):
        src = o_t - (W - 1) + w
        m = (m_t & (src >= start))[:, None] & m_d[None, :]
        xv = tl.load(x + src.to(tl.int64)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(ACC)
        acc += xv * tl.load(weight + o_d * W + w, mask=m_d, other=0.0).to(ACC)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + o_t.to(tl.int64)[:, None] * D + o_d[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit
def causal_conv1d_bwd_kernel(x, weight, bias, dy, dx, dweight_part, dbias_part, seq_start, seq_end, T,
                             D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                             HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr):
    """dx[t] = sum_s weight[W-1-s] * dpre[t+s] over rows t+s of t's sequence; the pre-activation
    is recomputed. Weight and bias gradients are written per block of rows and summed by the caller."""
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    start = tl.load(seq_start + o_t, mask=m_t, other=0)
    end = tl.load(seq_end + o_t, mask=m_t, other=0)
    dxv = tl.zeros([BT, BD], dtype=ACC)
    dpre_t = tl.zeros([BT, BD], dtype=ACC)
    for s in tl.static_range(W):
        r = o_t + s
        m_r = m_t & (r < end)
        pre = tl.zeros([BT, BD], dtype=ACC)
        if HAS_BIAS:
            pre += tl.load(bias + o_d, mask=m_d, other=0.0).to(ACC)[None, :]
        for w in tl.static_range(W):
            src = r - (W - 1) + w
            m = (m_r & (src >= start))[:, None] & m_d[None, :]
            xv = tl.load(x + src.to(tl.int64)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(ACC)
            pre += xv * tl.load(weight + o_d * W + w, mask=m_d, other=0.0).to(ACC)[None, :]
        dpre = tl.load(dy + r.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                       other=0.0).to(ACC)
        if SILU:
            sig = tl.sigmoid(pre)
            dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
        dxv += dpre * tl.load(weight + o_d * W + (W - 1 - s), mask=m_d, other=0.0).to(ACC)[None, :]
        if s == 0:
            dpre_t = dpre
    tl.store(dx + o_t.to(tl.int64)[:, None] * D + o_d[None, :], dxv.to(dx.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])
    for w in tl.static_range(W):
        src = o_t - (W - 1) + w
        m = (m_t & (src >= start))[:, None] & m_d[None, :]
        xv = tl.load(x + src.to(tl.int64)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(ACC)
        tl.store(dweight_part + (i_t * W + w) * D + o_d, tl.sum(dpre_t * xv, axis=0), mask=m_d)
    if HAS_BIAS:
        tl.store(dbias_part + i_t * D + o_d, tl.sum(dpre_t, axis=0), mask=m_d)


def _token_bounds(cu_seqlens: torch.Tensor, T: int):
    """Per-token start and end of its sequence, computed on the device (no host sync)."""
    cu = cu_seqlens.to(torch.int64)
    seq = torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)
    return cu[seq].to(torch.int32).contiguous(), cu[seq + 1].to(torch.int32).contiguous()


def _blocks(D: int, backward: bool) -> tuple[int, int]:
    """Rows x channels per program: small enough that the unrolled W x W loop keeps its fp32 tiles
    in registers (the backward holds about five of them)."""
    return (32 if backward else 64), min(64, next_pow2(D))


class CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seq_start, seq_end, silu):
        T, D = x.shape
        W = weight.shape[1]
        prec = precision_for(x.dtype)
        y = torch.empty_like(x)
        BT, BD = _blocks(D, backward=False)
        causal_conv1d_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
            x, weight, bias, y, seq_start, T, D=D, W=W, BT=BT, BD=BD, HAS_BIAS=bias is not None, SILU=silu,
            ACC=prec.acc)
        ctx.save_for_backward(x, weight, bias, seq_start, seq_end)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, seq_start, seq_end = ctx.saved_tensors
        T, D = x.shape
        W = weight.shape[1]
        prec = precision_for(x.dtype)
        BT, BD = _blocks(D, backward=True)
        nt = triton.cdiv(T, BT)
        dx = torch.empty_like(x)
        dw_part = torch.empty(nt, W, D, dtype=prec.acc_torch, device=x.device)
        db_part = torch.empty(nt, D, dtype=prec.acc_torch, device=x.device) if bias is not None else None
        causal_conv1d_bwd_kernel[(nt, triton.cdiv(D, BD))](
            x, weight, bias, dy.contiguous(), dx, dw_part, db_part, seq_start, seq_end, T, D=D, W=W, BT=BT, BD=BD,
            HAS_BIAS=bias is not None, SILU=ctx.silu, ACC=prec.acc)
        dweight = dw_part.sum(0).T.to(weight.dtype)
        dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, None, None, None


def causal_conv1d(x, weight, bias=None, *, activation="silu", cu_seqlens=None):
    """Depthwise causal conv over x [B, T, D] with weight [D, W]; varlen through cu_seqlens (B == 1)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(map(str, _ACTIVATIONS))}, got {activation!r}")
    B, T, D = x.shape
    if weight.shape[0] != D:
        raise ValueError(f"weight must be [{D}, W], got {tuple(weight.shape)}")
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=x.device)
    elif B != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1 (one packed row), got {B}")
    seq_start, seq_end = _token_bounds(cu_seqlens, B * T)
    y = CausalConv1d.apply(x.reshape(B * T, D).contiguous(), weight.contiguous(),
                           None if bias is None else bias.contiguous(), seq_start, seq_end,
                           _ACTIVATIONS[activation])
    return y.view(B, T, D)


def causal_conv1d_reference(x, weight, bias=None, *, activation="silu", cu_seqlens=None):
    """Naive PyTorch version: one F.conv1d per sequence with W-1 zeros of left padding."""
    B, T, D = x.shape
    W = weight.shape[1]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * T, T)
    rows = x.reshape(B * T, D)
    outs = []
    for bos, eos in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        seq = F.pad(rows[bos:eos].T[None], (W - 1, 0))
        outs.append(F.conv1d(seq, weight[:, None, :], bias, groups=D)[0].T)
    y = torch.cat(outs)
    if _ACTIVATIONS[activation]:
        y = F.silu(y)
    return y.view(B, T, D)
