"""The row-window causal conv1d kernels: each program walks a chunk of rows of one channel block.

A program takes L rows (a chunk) of BD channels and steps through them R rows at a time, from the
chunk's last rows to its first. Each step loads only R new rows of x (and of dy): the W-1 rows of x
that the step shares with the one before, and (backward) the W-1 rows of the pre-activation gradient
above the step, are carried in registers. So every element of x, dy and dx crosses L1 once, the
activation is evaluated once per element, and no scratch memory or barrier is needed.

Rows of a step sit inside one thread (a [R, BD] tile whose row axis no lane or warp splits, when BD
is at least 32 lanes times the vector width per warp), so the row shifts below (`_take`) are
register renames once the compiler folds the constant row compares; otherwise they stay correct
and cost a few selects. The step loop is a `tl.range` with `num_stages`, which lets Triton pipeline
its loads (it pipelines loads of loops without a matrix product only when a loop asks).

Backward: dx[u] = sum_s weight[W-1-s] * dpre[u+s] over rows u+s of u's sequence, dweight[w] =
sum_u dpre[u] * x[u-(W-1)+w] over rows of u's sequence, dbias = sum_u dpre[u]; weight and bias
gradients are written once per program as fp32 partial sums, one row per chunk, and summed by
`sum_partials_kernel` (one small launch that also casts to the parameters' dtypes).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import sequence_of


@triton.jit
def _row(A, SA: tl.constexpr, i: tl.constexpr):
    """Row i of the [SA, BD] tile A as a [BD] vector (-0.0 elsewhere: x + -0.0 is x, NaN included)."""
    return tl.sum(tl.where(tl.arange(0, SA)[:, None] == i, A, -0.0), axis=0)


@triton.jit
def _take(A, B, FIRST: tl.constexpr, NA: tl.constexpr, SA: tl.constexpr, NB: tl.constexpr, SB: tl.constexpr,
          N: tl.constexpr, SN: tl.constexpr, BD: tl.constexpr):
    """[SN, BD] tile of rows FIRST .. FIRST+N-1 of (the first NA rows of A, then the first NB of B);
    rows past those are zero. SA, SB, SN: the tiles' row counts (powers of two)."""
    o_n = tl.arange(0, SN)[:, None]
    out = tl.zeros([SN, BD], dtype=A.dtype)
    for i in tl.static_range(N):
        if FIRST + i < NA:
            out = tl.where(o_n == i, _row(A, SA, FIRST + i)[None, :], out)
        elif FIRST + i - NA < NB:
            out = tl.where(o_n == i, _row(B, SB, FIRST + i - NA)[None, :], out)
    return out


@triton.jit
def _step_rows(cu_seqlens, g, o_r, n_iter, N, T):
    """Rows g .. g+R-1: in bounds, position in their sequence, rows left to its end (counting itself)."""
    rows = g + o_r
    m = rows < T
    seq = sequence_of(cu_seqlens, rows, m, n_iter, N)
    start = tl.load(cu_seqlens + seq, mask=m, other=0)
    end = tl.load(cu_seqlens + seq + 1, mask=m, other=0)
    return rows, m, rows - start, end - rows


@triton.jit
def _load_rows(p, rows, T, o_d, m_d, D: tl.constexpr, ACC: tl.constexpr, extra_mask):
    m = ((rows >= 0) & (rows < T) & extra_mask)[:, None] & m_d[None, :]
    return tl.load(p + rows.to(tl.int64)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(ACC)


@triton.jit
def _pre_activation(xn, xc, pos, wt, bias_row, W: tl.constexpr, WP: tl.constexpr, HP: tl.constexpr,
                    R: tl.constexpr, BD: tl.constexpr, MASKED: tl.constexpr):
    """bias + sum_k weight[W-1-k] * x[u-k] over k <= pos(u), for the R rows u = g + i; xn holds x at
    rows g-(W-1) .. g+R-W, xc at g+R-(W-1) .. g+R-1. MASKED=False: every row has all W taps."""
    pre = tl.zeros([R, BD], dtype=xn.dtype) + bias_row[None, :]
    for k in tl.static_range(W):
        pre += _tap(xn, xc, pos, k, W, HP, R, BD, MASKED) * _row(wt, WP, W - 1 - k)[None, :]
    return pre


@triton.jit
def _tap(xn, xc, pos, k: tl.constexpr, W: tl.constexpr, HP: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
         MASKED: tl.constexpr):
    """x[u-k] for the R rows u of a step, zero where u-k is before u's sequence (k = 0 never is)."""
    xs = _take(xn, xc, W - 1 - k, R, R, W - 1, HP, R, R, BD)
    if MASKED and k > 0:
        xs = tl.where((pos >= k)[:, None], xs, 0.0)
    return xs


@triton.jit
def _bwd_step(xn, xc, dp, da, pos, rem, own, wt, b, dw_acc, db_acc, W: tl.constexpr, WP: tl.constexpr,
              HP: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr, MASKED: tl.constexpr):
    """One step of the backward: (dpre of the step's rows, dweight and dbias sums, dx of its rows).
    dp comes in as dy; MASKED=False when no tap or shift of the step crosses a sequence boundary."""
    if SILU:
        pre = _pre_activation(xn, xc, pos, wt, b, W, WP, HP, R, BD, MASKED)
        sig = tl.sigmoid(pre)
        dp = dp * sig * (1.0 + pre * (1.0 - sig))
    dp_own = tl.where(own, dp, 0.0)
    db_acc += tl.sum(dp_own, axis=0)
    o_w = tl.arange(0, WP)
    for k in tl.static_range(W):
        part = tl.sum(dp_own * _tap(xn, xc, pos, k, W, HP, R, BD, MASKED), axis=0)
        dw_acc += tl.where(o_w[:, None] == W - 1 - k, part[None, :], 0.0)
    dxv = tl.zeros([R, BD], dtype=dp.dtype)
    for s in tl.static_range(W):
        dps = _take(dp, da, s, R, R, W - 1, HP, R, R, BD)  # dpre at rows u + s
        if MASKED and s > 0:  # rem >= 1 on every stored row
            dps = tl.where((rem > s)[:, None], dps, 0.0)
        dxv += dps * _row(wt, WP, W - 1 - s)[None, :]
    return dp, dw_acc, db_acc, dxv


@triton.jit
def _interior(pos, rem, W: tl.constexpr):
    """No row of the step has a tap before its sequence or a shift past its end."""
    return (tl.min(pos, axis=0) >= W - 1) & (tl.min(rem, axis=0) >= W)


@triton.jit
def _weights(weight, bias, o_d, m_d, W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
             ACC: tl.constexpr):
    o_w = tl.arange(0, WP)
    wt = tl.load(weight + o_d[None, :] * W + o_w[:, None], mask=(o_w < W)[:, None] & m_d[None, :], other=0.0).to(ACC)
    if HAS_BIAS:
        b = tl.load(bias + o_d, mask=m_d, other=0.0).to(ACC)
    else:
        b = tl.zeros([BD], dtype=ACC)
    return wt, b


@triton.jit
def causal_conv1d_fwd_window_kernel(x, weight, bias, y, cu_seqlens, n_iter, N, T, D: tl.constexpr, W: tl.constexpr,
                                    WP: tl.constexpr, HP: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
                                    BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                                    STAGES: tl.constexpr, FAST: tl.constexpr):
    """FAST: steps inside one sequence skip the per-row masks (a branch per step)."""
    c0 = tl.program_id(0) * L
    o_r = tl.arange(0, R)
    o_h = tl.arange(0, HP)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    wt, b = _weights(weight, bias, o_d, m_d, W, WP, BD, HAS_BIAS, ACC)
    # x rows g+R-(W-1) .. g+R-1 of the first (highest) step g = c0 + L - R
    xc = _load_rows(x, c0 + L - (W - 1) + o_h, T, o_d, m_d, D, ACC, o_h < W - 1)
    for j in tl.range(0, L // R, num_stages=STAGES):
        g = c0 + L - R - j * R
        xn = _load_rows(x, g - (W - 1) + o_r, T, o_d, m_d, D, ACC, o_r >= 0)
        rows, m, pos, _ = _step_rows(cu_seqlens, g, o_r, n_iter, N, T)
        if FAST:
            if tl.min(pos, axis=0) >= W - 1:
                out = _pre_activation(xn, xc, pos, wt, b, W, WP, HP, R, BD, False)
            else:
                out = _pre_activation(xn, xc, pos, wt, b, W, WP, HP, R, BD, True)
        else:
            out = _pre_activation(xn, xc, pos, wt, b, W, WP, HP, R, BD, True)
        if SILU:
            out = out * tl.sigmoid(out)
        tl.store(y + rows.to(tl.int64)[:, None] * D + o_d[None, :], out.to(y.dtype.element_ty),
                 mask=m[:, None] & m_d[None, :])
        xc = _take(xn, xc, 0, R, R, W - 1, HP, W - 1, HP, BD)


@triton.jit
def causal_conv1d_bwd_window_kernel(x, weight, bias, dy, dx, part, cu_seqlens, n_iter, N, T, D: tl.constexpr,
                                    W: tl.constexpr, WP: tl.constexpr, HP: tl.constexpr, R: tl.constexpr,
                                    L: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                                    ACC: tl.constexpr, PS: tl.constexpr, NH: tl.constexpr, STAGES: tl.constexpr,
                                    FAST: tl.constexpr):
    """Program (c, j): rows c*L .. c*L+L-1 of channel block j. The first NH = ceil((W-1)/R) steps
    are the rows after the chunk (a halo: their pre-activation gradient feeds dx of the chunk's last
    W-1 rows; they write and sum nothing). part[c] (PS values a row) gets this chunk's dweight
    ([D, W] flattened), then dbias. FAST: steps inside one sequence skip the per-row masks."""
    i_c = tl.program_id(0)
    c0 = i_c * L
    o_r = tl.arange(0, R)
    o_h = tl.arange(0, HP)
    o_w = tl.arange(0, WP)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    wt, b = _weights(weight, bias, o_d, m_d, W, WP, BD, HAS_BIAS, ACC)
    g0 = c0 + L + (NH - 1) * R  # the first (highest) step
    xc = _load_rows(x, g0 + R - (W - 1) + o_h, T, o_d, m_d, D, ACC, o_h < W - 1)
    da = tl.zeros([HP, BD], dtype=ACC)  # dpre at rows g+R .. g+R+W-2
    dw_acc = tl.zeros([WP, BD], dtype=ACC)
    db_acc = tl.zeros([BD], dtype=ACC)
    for j in tl.range(0, L // R + NH, num_stages=STAGES):
        g = g0 - j * R
        xn = _load_rows(x, g - (W - 1) + o_r, T, o_d, m_d, D, ACC, o_r >= 0)
        rows, m, pos, rem = _step_rows(cu_seqlens, g, o_r, n_iter, N, T)
        dp = _load_rows(dy, rows, T, o_d, m_d, D, ACC, o_r >= 0)
        own = j >= NH
        if FAST:
            if _interior(pos, rem, W):
                dp, dw_acc, db_acc, dxv = _bwd_step(xn, xc, dp, da, pos, rem, own, wt, b, dw_acc, db_acc, W, WP, HP,
                                                    R, BD, SILU, False)
            else:
                dp, dw_acc, db_acc, dxv = _bwd_step(xn, xc, dp, da, pos, rem, own, wt, b, dw_acc, db_acc, W, WP, HP,
                                                    R, BD, SILU, True)
        else:
            dp, dw_acc, db_acc, dxv = _bwd_step(xn, xc, dp, da, pos, rem, own, wt, b, dw_acc, db_acc, W, WP, HP, R,
                                                BD, SILU, True)
        tl.store(dx + rows.to(tl.int64)[:, None] * D + o_d[None, :], dxv.to(dx.dtype.element_ty),
                 mask=(m & own)[:, None] & m_d[None, :])
        xc = _take(xn, xc, 0, R, R, W - 1, HP, W - 1, HP, BD)
        da = _take(dp, da, 0, R, R, W - 1, HP, W - 1, HP, BD)
    row = part + i_c.to(tl.int64) * PS
    tl.store(row + o_d[None, :] * W + o_w[:, None], dw_acc, mask=(o_w < W)[:, None] & m_d[None, :])
    if HAS_BIAS:
        tl.store(row + D * W + o_d, db_acc, mask=m_d)
