"""Depthwise causal conv1d with a per-sequence initial state: the taps before a sequence's start read
its state rows instead of zeros, and the backward returns the state's gradient.

`state: [N, W-1, D]`, row `W-1-j` is the input `j` rows before sequence n's first row (the slot's
`initial_state`); or, for the shared-prefix look-back, `[N, W]` rows of x itself (slot 0 unread, -1
for a zero row: layout "x" of `shared_prefix.conv.LookBackConv`), so that nothing is gathered
around the call. One design, the portable one: [BT, BD]
tiles forward; backward recomputes the pre-activation at the W shifted rows each dx row reads
(the "recompute" design of causal_conv1d.py), and extra programs of the same launch compute the
state gradient, BN sequences each: no launch beyond the stateless conv's. Naive reference beside:
`patchgen.kernels.reference.causal_conv1d.causal_conv1d(..., initial_state=...)`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import next_pow2, precision_for, search_steps, sequence_of, sum_partials


@triton.jit
def _tap(x, state, seq, start, src, m_rows, o_d, m_d, D: tl.constexpr, W: tl.constexpr, ACC: tl.constexpr,
         FROM_X: tl.constexpr):
    """Input row `src` of each row's sequence: x inside it, the sequence's state row before its start
    (FROM_X: `state` holds, per sequence, the rows of x that are its state, -1 for a zero row)."""
    inside = m_rows & (src >= start)
    xv = tl.load(x + src.to(tl.int64)[:, None] * D + o_d[None, :], mask=inside[:, None] & m_d[None, :], other=0.0)
    slot = src - start + (W - 1)
    before = m_rows & (src < start) & (slot >= 0)
    if FROM_X:
        row = tl.load(state + seq.to(tl.int64) * W + slot + 1, mask=before, other=-1)
        sv = tl.load(x + row[:, None] * D + o_d[None, :], mask=(before & (row >= 0))[:, None] & m_d[None, :],
                     other=0.0)
    else:
        sv = tl.load(state + (seq.to(tl.int64) * (W - 1) + slot)[:, None] * D + o_d[None, :],
                     mask=before[:, None] & m_d[None, :], other=0.0)
    return xv.to(ACC) + sv.to(ACC)


@triton.jit
def _pre(x, state, weight, bias, seq, start, rows, m_rows, o_d, m_d, D: tl.constexpr, W: tl.constexpr,
         HAS_BIAS: tl.constexpr, ACC: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, FROM_X: tl.constexpr):
    pre = tl.zeros([BR, BD], dtype=ACC)
    if HAS_BIAS:
        pre += tl.load(bias + o_d, mask=m_d, other=0.0).to(ACC)[None, :]
    for w in tl.static_range(W):
        xv = _tap(x, state, seq, start, rows - (W - 1) + w, m_rows, o_d, m_d, D, W, ACC, FROM_X)
        pre += xv * tl.load(weight + o_d * W + w, mask=m_d, other=0.0).to(ACC)[None, :]
    return pre


@triton.jit
def causal_conv1d_state_fwd_kernel(x, state, weight, bias, y, cu_seqlens, n_iter, N, T, D: tl.constexpr,
                                   W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
                                   SILU: tl.constexpr, ACC: tl.constexpr, FROM_X: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    seq = sequence_of(cu_seqlens, o_t, m_t, n_iter, N)
    start = tl.load(cu_seqlens + seq, mask=m_t, other=0)
    acc = _pre(x, state, weight, bias, seq, start, o_t, m_t, o_d, m_d, D, W, HAS_BIAS, ACC, BT, BD, FROM_X)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + o_t.to(tl.int64)[:, None] * D + o_d[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _dpre(x, state, weight, bias, dy, seq, start, end, rows, m_rows, o_d, m_d, D: tl.constexpr, W: tl.constexpr,
          HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
          FROM_X: tl.constexpr):
    """The gradient before the activation at `rows` (zero outside their sequence)."""
    m_r = m_rows & (rows >= start) & (rows < end)
    dpre = tl.load(dy + rows.to(tl.int64)[:, None] * D + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                   other=0.0).to(ACC)
    if SILU:
        pre = _pre(x, state, weight, bias, seq, start, rows, m_r, o_d, m_d, D, W, HAS_BIAS, ACC, BR, BD, FROM_X)
        sig = tl.sigmoid(pre)
        dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
    return dpre


@triton.jit
def causal_conv1d_state_bwd_kernel(x, state, weight, bias, dy, dx, dstate, part, cu_seqlens, n_iter, N, T,
                                   n_row_tiles, D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                                   BN: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                                   ACC: tl.constexpr, PS: tl.constexpr, FROM_X: tl.constexpr):
    """Programs 0 .. n_row_tiles-1: dx of BT rows, and their rows' weight and bias gradients (the
    taps before a start read the state); programs from n_row_tiles on: dstate of BN sequences,
    dstate[n, j] = sum_s weight[W-1-s] * dpre[start_n - (W-1) + j + s] over rows inside sequence n."""
    i_t = tl.program_id(0)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    if i_t < n_row_tiles:
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        seq = sequence_of(cu_seqlens, o_t, m_t, n_iter, N)
        start = tl.load(cu_seqlens + seq, mask=m_t, other=0)
        end = tl.load(cu_seqlens + seq + 1, mask=m_t, other=0)
        dxv = tl.zeros([BT, BD], dtype=ACC)
        dpre_t = tl.zeros([BT, BD], dtype=ACC)
        for s in tl.static_range(W):
            dpre = _dpre(x, state, weight, bias, dy, seq, start, end, o_t + s, m_t, o_d, m_d, D, W, HAS_BIAS,
                         SILU, ACC, BT, BD, FROM_X)
            dxv += dpre * tl.load(weight + o_d * W + (W - 1 - s), mask=m_d, other=0.0).to(ACC)[None, :]
            if s == 0:
                dpre_t = dpre
        tl.store(dx + o_t.to(tl.int64)[:, None] * D + o_d[None, :], dxv.to(dx.dtype.element_ty),
                 mask=m_t[:, None] & m_d[None, :])
        for w in tl.static_range(W):
            xv = _tap(x, state, seq, start, o_t - (W - 1) + w, m_t, o_d, m_d, D, W, ACC, FROM_X)
            tl.store(part + i_t.to(tl.int64) * PS + o_d * W + w, tl.sum(dpre_t * xv, axis=0), mask=m_d)
        if HAS_BIAS:
            tl.store(part + i_t.to(tl.int64) * PS + D * W + o_d, tl.sum(dpre_t, axis=0), mask=m_d)
    else:
        o_n = (i_t - n_row_tiles) * BN + tl.arange(0, BN)
        m_n = o_n < N
        # own names: Triton's compiler requires a name bound in both branches to have one type
        start_n = tl.load(cu_seqlens + o_n, mask=m_n, other=0)
        end_n = tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0)
        for j in tl.static_range(W - 1):
            acc = tl.zeros([BN, BD], dtype=ACC)
            for s in tl.static_range(W):
                rows = start_n - (W - 1) + j + s
                dpre_n = _dpre(x, state, weight, bias, dy, o_n, start_n, end_n, rows, m_n, o_d, m_d, D, W, HAS_BIAS,
                             SILU, ACC, BN, BD, FROM_X)
                acc += dpre_n * tl.load(weight + o_d * W + (W - 1 - s), mask=m_d, other=0.0).to(ACC)[None, :]
            if FROM_X:  # a slot without a row of x gets no gradient (the caller adds every slot into dx)
                row = tl.load(state + o_n.to(tl.int64) * W + j + 1, mask=m_n, other=-1)
                acc = tl.where((row >= 0)[:, None], acc, 0.0)
            tl.store(dstate + (o_n.to(tl.int64) * (W - 1) + j)[:, None] * D + o_d[None, :],
                     acc.to(dstate.dtype.element_ty), mask=m_n[:, None] & m_d[None, :])


BT, BN, BD = 32, 16, 64


@functools.lru_cache(maxsize=256)
def _shape(T, D, N):
    bd = min(BD, next_pow2(D))
    return triton.cdiv(T, BT), triton.cdiv(N, BN), triton.cdiv(D, bd), bd, search_steps(N)


def conv_state_fwd(x, state, weight, bias, cu_seqlens, silu: bool, from_x: bool = False):
    """y [T, D] of x [T, D] (contiguous), every sequence of cu_seqlens starting from its state:
    rows `[N, W-1, D]`, or (`from_x`) `[N, W]` int64 rows of x (slot 0 unread, -1: a zero row)."""
    T, D = x.shape
    N = cu_seqlens.shape[0] - 1
    n_t, _, n_d, bd, n_iter = _shape(T, D, N)
    y = torch.empty_like(x)
    causal_conv1d_state_fwd_kernel[(n_t, n_d)](x, state, weight, bias, y, cu_seqlens, n_iter, N, T, D=D,
                                                W=weight.shape[1], BT=BT, BD=bd, HAS_BIAS=bias is not None,
                                                SILU=silu, ACC=precision_for(x.dtype).acc, FROM_X=from_x)
    return y


def conv_state_bwd(x, state, weight, bias, dy, cu_seqlens, silu: bool, from_x: bool = False):
    """(dx, dweight, dbias or None, dstate [N, W-1, D]); with `from_x`, dx holds no state gradient and
    dstate is zero at the slots without a row."""
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.shape[0] - 1
    n_t, n_n, n_d, bd, n_iter = _shape(T, D, N)
    PS = D * W + (D if bias is not None else 0)
    dx = torch.empty_like(x)
    dstate = x.new_empty(N, W - 1, D) if from_x else torch.empty_like(state)
    part = torch.empty(n_t, PS, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    causal_conv1d_state_bwd_kernel[(n_t + n_n, n_d)](
        x, state, weight, bias, dy, dx, dstate, part, cu_seqlens, n_iter, N, T, n_t, D=D, W=W, BT=BT, BN=BN, BD=bd,
        HAS_BIAS=bias is not None, SILU=silu, ACC=precision_for(x.dtype).acc, PS=PS, FROM_X=from_x,
    )
    dweight = torch.empty_like(weight)
    dbias = None if bias is None else torch.empty_like(bias)
    sum_partials(part, dweight, dbias)
    return dx, dweight, dbias, dstate


_SILU = {None: False, "identity": False, "silu": True, "swish": True}


class LookBack:
    """State kernels for `shared_prefix.conv.LookBackConv`, layout "x": the kernels read each segment's
    look-back rows from x itself (`state`: `[S, W]` rows of x, -1 for a zero row), so the forward
    gathers nothing; the backward's dstate goes into dx by one index_add_."""

    layout = "x"
    plan_tables = True  # the plan's segment boundaries only, no host read: capturable (`shared_prefix/call_graphs.py`)

    def forward(self, x, weight, bias, state, idx, activation):
        B, T, D = x.shape
        # the kernels index weight and bias densely: a strided view would be read wrong, silently
        bias = None if bias is None else bias.contiguous()
        y = conv_state_fwd(x.reshape(T, D), state, weight.contiguous(), bias, idx.segment_cu, _SILU[activation], True)
        return y.view(B, T, D)

    def backward(self, x, weight, bias, state, dy, idx, activation):
        B, T, D = x.shape
        bias = None if bias is None else bias.contiguous()
        dx, dweight, dbias, dstate = conv_state_bwd(x.reshape(T, D), state, weight.contiguous(), bias,
                                                    dy.reshape(T, D), idx.segment_cu, _SILU[activation], True)
        return dx.view(B, T, D), dweight, dbias, dstate


class CausalConv1dState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state, cu_seqlens, silu):
        ctx.save_for_backward(x, weight, bias, state, cu_seqlens)
        ctx.silu = silu
        return conv_state_fwd(x, state, weight, bias, cu_seqlens, silu)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, state, cu_seqlens = ctx.saved_tensors
        dx, dweight, dbias, dstate = conv_state_bwd(x, state, weight, bias, dy.contiguous(), cu_seqlens, ctx.silu)
        return dx, dweight, dbias, dstate, None, None
