"""Depthwise causal conv1d over one packed row, varlen, optional SiLU; forward and backward.

y[t, d] = act(bias[d] + sum_w weight[d, w] * x[t - (W-1) + w, d]), where rows before the start
of t's sequence read as zero (every sequence starts from a zero state). W is a kernel parameter.

Each row finds its sequence by a binary search over cu_seqlens inside the kernel, so a call costs
one launch per pass and no tensor work on the host. The backward computes the pre-activation
gradient once per row and shifts it through a small per-program scratch buffer that stays in L2
(a persistent grid reuses it), instead of recomputing the activation W times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import next_pow2, precision_for

_ACTIVATIONS = {None: False, "identity": False, "silu": True, "swish": True}


@triton.jit
def _sequence_of(cu_seqlens, o_t, m_t, n_iter, N):
    """Index of the sequence holding each row of o_t: the largest j < N with cu_seqlens[j] <= t."""
    lo = tl.zeros_like(o_t)
    hi = tl.zeros_like(o_t) + (N - 1)
    for _ in range(n_iter):
        mid = (lo + hi + 1) // 2
        take = tl.load(cu_seqlens + mid, mask=m_t, other=0) <= o_t
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    return lo


@triton.jit
def causal_conv1d_fwd_kernel(x, weight, bias, y, cu_seqlens, n_iter, N, T, D: tl.constexpr, W: tl.constexpr,
                             BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                             ACC: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    start = tl.load(cu_seqlens + _sequence_of(cu_seqlens, o_t, m_t, n_iter, N), mask=m_t, other=0)
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
def causal_conv1d_bwd_kernel(x, weight, bias, dy, dx, dweight_part, dbias_part, scratch, cu_seqlens, n_iter, N, T,
                             n_row_tiles, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                             BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                             ACC: tl.constexpr):
    """Persistent over rows: program (p, c) takes the row tiles p, p + P, ... of channel block c.
    Tiles of BT rows overlap by W-1 rows; each computes dpre (the gradient before the activation,
    the pre-activation recomputed) on all BT rows and writes dx for the first BT-W+1:
    dx[t] = sum_s weight[W-1-s] * dpre[t+s] over rows of t's sequence; the same shifted dpre tiles
    times the unshifted x give the weight gradient (x is read W times per tile, not 2W). Weight and
    bias gradients are summed in registers and written once per program."""
    i_p, i_d = tl.program_id(0), tl.program_id(1)
    OUT: tl.constexpr = BT - W + 1
    o_i = tl.arange(0, BT)
    o_w = tl.arange(0, WP)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    slot = i_d * tl.num_programs(0) + i_p
    pad = scratch + slot.to(tl.int64) * BT * BD + o_i[:, None] * BD + tl.arange(0, BD)[None, :]
    dw_acc = tl.zeros([WP, BD], dtype=ACC)
    db_acc = tl.zeros([BD], dtype=ACC)
    for tile in range(i_p, n_row_tiles, tl.num_programs(0)):
        o_t = tile * OUT + o_i
        m_t = o_t < T
        seq = _sequence_of(cu_seqlens, o_t, m_t, n_iter, N)
        start = tl.load(cu_seqlens + seq, mask=m_t, other=0)
        end = tl.load(cu_seqlens + seq + 1, mask=m_t, other=0)
        pre = tl.zeros([BT, BD], dtype=ACC)
        if HAS_BIAS:
            pre += tl.load(bias + o_d, mask=m_d, other=0.0).to(ACC)[None, :]
        for w in tl.static_range(W):
            src = o_t - (W - 1) + w
            m = (m_t & (src >= start))[:, None] & m_d[None, :]
            xv = tl.load(x + src.to(tl.int64)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(ACC)
            pre += xv * tl.load(weight + o_d * W + w, mask=m_d, other=0.0).to(ACC)[None, :]
        m_td = m_t[:, None] & m_d[None, :]
        dpre = tl.load(dy + o_t.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_td, other=0.0).to(ACC)
        if SILU:
            sig = tl.sigmoid(pre)
            dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
        own_rows = o_i < OUT  # rows OUT.. are the next tile's (here only as the halo of dpre)
        own = own_rows[:, None] & m_td
        if HAS_BIAS:
            db_acc += tl.sum(tl.where(own, dpre, 0.0), axis=0)
        x_here = xv  # the first loop's last load: x at the tile's own rows
        # shift dpre by s rows through this program's scratch tile (L2-resident, read back at once)
        tl.debug_barrier()
        tl.store(pad, dpre)
        tl.debug_barrier()
        dxv = tl.zeros([BT, BD], dtype=ACC)
        for s in tl.static_range(W):
            m_s = (o_i + s < BT) & (o_t + s < end)
            shifted = tl.load(pad + s * BD, mask=m_s[:, None], other=0.0, cache_modifier=".cg")
            dxv += shifted * tl.load(weight + o_d * W + (W - 1 - s), mask=m_d, other=0.0).to(ACC)[None, :]
            # dweight[:, W-1-s] = sum_u x[u] * dpre[u+s] over rows u+s of u's sequence; each u counted
            # by the tile that owns it
            part = tl.sum(tl.where(own_rows[:, None], shifted * x_here, 0.0), axis=0)
            dw_acc += tl.where(o_w[:, None] == W - 1 - s, part[None, :], 0.0)
        tl.store(dx + o_t.to(tl.int64)[:, None] * D + o_d[None, :], dxv.to(dx.dtype.element_ty), mask=own)
    base = (i_p * tl.num_programs(1) + i_d) * WP * BD
    tl.store(dweight_part + base + o_w[:, None] * BD + tl.arange(0, BD)[None, :], dw_acc)
    if HAS_BIAS:
        tl.store(dbias_part + (i_p * tl.num_programs(1) + i_d) * BD + tl.arange(0, BD), db_acc)


@triton.jit
def causal_conv1d_bwd_recompute_kernel(x, weight, bias, dy, dx, dweight_part, dbias_part, cu_seqlens, n_iter, N, T,
                                       D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                                       HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr):
    """The portable backward (no scratch, no barrier): dpre is recomputed at each of the W shifted
    rows that dx[t] = sum_s weight[W-1-s] * dpre[t+s] reads. Weight and bias gradients are written
    per block of rows and summed by the caller."""
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    seq = _sequence_of(cu_seqlens, o_t, m_t, n_iter, N)
    start = tl.load(cu_seqlens + seq, mask=m_t, other=0)
    end = tl.load(cu_seqlens + seq + 1, mask=m_t, other=0)
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


@dataclass(frozen=True)
class ConvTuning:
    """Tile shapes and launch options; see docs/triton_kernels.md for how they were chosen."""

    fwd_bt: int = 32
    fwd_bd: int = 128
    fwd_warps: int = 4
    bwd_bt: int = 64
    bwd_bd: int = 64
    bwd_warps: int = 4
    bwd_programs_per_sm: int = 8
    bwd_stages: int | None = None  # software pipelining of the persistent loop; None: Triton's default
    # "scratch": the persistent backward that shifts dpre through a per-program scratch tile, which
    # relies on a barrier making a program's global stores visible to its own threads (CUDA's
    # bar.sync does); "recompute": the portable one. None: scratch on CUDA, recompute elsewhere.
    bwd_shift: str | None = None
    recompute_bt: int = 32
    recompute_bd: int = 64


TUNING = ConvTuning()
_SM_COUNT: dict[int, int] = {}


def _row_programs(device: torch.device, per_sm: int, n_row_tiles: int, n_channel_blocks: int) -> int:
    """Programs per channel block of the persistent backward: about per_sm programs on every
    multiprocessor in all (the count is read once per device). The interpreter gets two, so that
    the tests run the loop over several tiles."""
    if device.type != "cuda":
        return min(n_row_tiles, 2)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(n_row_tiles, per_sm * _SM_COUNT[index] // n_channel_blocks))


def _stages(num_stages: int | None) -> dict:
    return {} if num_stages is None else {"num_stages": num_stages}


def _search_steps(num_seqs: int) -> int:
    return max(1, (num_seqs - 1).bit_length())


def conv_fwd(x, weight, bias, cu_seqlens, silu: bool, tuning: ConvTuning = TUNING):
    T, D = x.shape
    W = weight.shape[1]
    prec = precision_for(x.dtype)
    y = torch.empty_like(x)
    N = cu_seqlens.numel() - 1
    BT, BD = tuning.fwd_bt, min(tuning.fwd_bd, next_pow2(D))
    causal_conv1d_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
        x, weight, bias, y, cu_seqlens, _search_steps(N), N, T, D=D, W=W, BT=BT, BD=BD,
        HAS_BIAS=bias is not None, SILU=silu, ACC=prec.acc, num_warps=tuning.fwd_warps)
    return y


def conv_bwd(x, weight, bias, dy, cu_seqlens, silu: bool, tuning: ConvTuning = TUNING):
    """(dx, dweight, dbias or None)."""
    shift = tuning.bwd_shift or ("scratch" if x.device.type in ("cuda", "cpu") else "recompute")
    if shift == "recompute":
        return _conv_bwd_recompute(x, weight, bias, dy, cu_seqlens, silu, tuning)
    if shift != "scratch":
        raise ValueError(f"bwd_shift must be 'scratch' or 'recompute', got {shift!r}")
    T, D = x.shape
    W = weight.shape[1]
    prec = precision_for(x.dtype)
    N = cu_seqlens.numel() - 1
    BT, BD = max(tuning.bwd_bt, next_pow2(2 * W)), min(tuning.bwd_bd, next_pow2(D))
    WP = next_pow2(W)
    n_row_tiles = triton.cdiv(T, BT - W + 1)
    n_d = triton.cdiv(D, BD)
    P = _row_programs(x.device, tuning.bwd_programs_per_sm, n_row_tiles, n_d)
    dx = torch.empty_like(x)
    scratch = torch.empty(P * n_d, BT, BD, dtype=prec.acc_torch, device=x.device)
    dw_part = torch.empty(P, n_d, WP, BD, dtype=prec.acc_torch, device=x.device)
    db_part = torch.empty(P, n_d, BD, dtype=prec.acc_torch, device=x.device) if bias is not None else None
    causal_conv1d_bwd_kernel[(P, n_d)](
        x, weight, bias, dy, dx, dw_part, db_part, scratch, cu_seqlens, _search_steps(N), N, T, n_row_tiles,
        D=D, W=W, WP=WP, BT=BT, BD=BD, HAS_BIAS=bias is not None, SILU=silu, ACC=prec.acc,
        num_warps=tuning.bwd_warps, **_stages(tuning.bwd_stages))
    dweight = dw_part.sum(0).transpose(1, 2).reshape(n_d * BD, WP)[:D, :W].to(weight.dtype)
    dbias = None if bias is None else db_part.sum(0).reshape(n_d * BD)[:D].to(bias.dtype)
    return dx, dweight, dbias


def _conv_bwd_recompute(x, weight, bias, dy, cu_seqlens, silu: bool, tuning: ConvTuning):
    T, D = x.shape
    W = weight.shape[1]
    prec = precision_for(x.dtype)
    N = cu_seqlens.numel() - 1
    BT, BD = tuning.recompute_bt, min(tuning.recompute_bd, next_pow2(D))
    nt = triton.cdiv(T, BT)
    dx = torch.empty_like(x)
    dw_part = torch.empty(nt, W, D, dtype=prec.acc_torch, device=x.device)
    db_part = torch.empty(nt, D, dtype=prec.acc_torch, device=x.device) if bias is not None else None
    causal_conv1d_bwd_recompute_kernel[(nt, triton.cdiv(D, BD))](
        x, weight, bias, dy, dx, dw_part, db_part, cu_seqlens, _search_steps(N), N, T, D=D, W=W, BT=BT, BD=BD,
        HAS_BIAS=bias is not None, SILU=silu, ACC=prec.acc)
    dweight = dw_part.sum(0).T.to(weight.dtype)
    return dx, dweight, (db_part.sum(0).to(bias.dtype) if bias is not None else None)


class CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cu_seqlens, silu):
        y = conv_fwd(x, weight, bias, cu_seqlens, silu)
        ctx.save_for_backward(x, weight, bias, cu_seqlens)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens = ctx.saved_tensors
        dx, dweight, dbias = conv_bwd(x, weight, bias, dy.contiguous(), cu_seqlens, ctx.silu)
        return dx, dweight, dbias, None, None


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
    if cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    y = CausalConv1d.apply(x.reshape(B * T, D).contiguous(), weight.contiguous(),
                           None if bias is None else bias.contiguous(), cu_seqlens.contiguous(),
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
