"""The segment causal conv1d kernels: the row window of causal_conv1d_window.py, walked per sequence.

Why (docs/triton_kernels.md, "conv: what bounds the window kernels"): compiled for Hopper, the window
backward's step is ~1,700 instructions for 32 elements a thread (~53 an element) at 255 registers,
so it is bound by instruction issue at 8 warps a multiprocessor, not by memory. Most of the excess is
per element: a select per tap and per shift for rows whose taps cross a sequence start or whose
shifts cross a sequence end, a select for the halo steps, adds of zeros into the weight-gradient rows,
and a binary search over cu_seqlens per row and step.

Here a program still owns L rows (a chunk) of BD channels, but splits them at sequence boundaries
into segments and walks each segment by itself, R rows a step from its last rows to its first. Inside
one segment every row belongs to one sequence, so the causal padding and the sequence ends are just
rows that load as zero: x outside [start, end) of the sequence and dy outside [segment start,
sequence end) are masked *loads* (one predicate a row), and no element is selected. Per element that
leaves the arithmetic (W FMAs for the pre-activation, the SiLU derivative, W for the weight gradient,
W for dx) and the conversions. The sequence of a program's first row is found once (a scalar binary
search); the halo steps above a segment that stops at the chunk's end run before the loop, so the
loop's body has no branch. Rows with no dy (below the segment, past the sequence) get a zero
pre-activation gradient, so they add nothing to the weight and bias gradients.

Registers: at BD = 256 channels a warp (16-byte bf16 vectors, 8 channels a thread) the backward takes
all 255 registers (8 one-warp programs a multiprocessor); `VEC` = 4 with BD = 128 (4 channels a
thread, 8-byte loads, still whole 128-byte lines a row and warp) fits in 128 without spilling (16
programs), for ~15% more instructions an element (counts from ptxas for sm_90).

Rows past cu_seqlens[-1] count as part of the last sequence, and rows before cu_seqlens[0] as part
of the first (what the other conv kernels compute too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .causal_conv1d_window import _row, _take, _weights


@triton.jit
def _channels(BD: tl.constexpr, VEC: tl.constexpr):
    """0 .. BD-1; VEC > 0 caps the channels a load takes together (the vector width) at VEC, so that
    a one-warp [R, BD] tile with BD = 32 * VEC keeps its R rows inside each thread with fewer channels
    (and registers) a thread than the 16-byte vectors the compiler would choose."""
    o = tl.arange(0, BD)
    if VEC > 0:
        o = tl.max_contiguous(o, VEC)
    return o


@triton.jit
def _sequence_of_row(cu_seqlens, row, n_iter, N):
    """The sequence holding `row` (a scalar): the largest j < N with cu_seqlens[j] <= row."""
    lo = row * 0
    hi = lo + (N - 1)
    for _ in range(n_iter):
        mid = (lo + hi + 1) // 2
        take = tl.load(cu_seqlens + mid) <= row
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    return lo


@triton.jit
def _bounds(cu_seqlens, s, N, T):
    """[start, end) of sequence s, the first starting at row 0 and the last ending at row T."""
    start = tl.where(s == 0, 0, tl.load(cu_seqlens + s))
    end = tl.where(s == N - 1, T, tl.load(cu_seqlens + s + 1))
    return start, end


@triton.jit
def _load(p, g, o_r, lo, hi, o_d, m_d, D: tl.constexpr, ACC: tl.constexpr, n_rows: tl.constexpr):
    """Rows g + o_r of p (the first n_rows of o_r), zero outside [lo, hi)."""
    rows = g + o_r
    m = ((rows >= lo) & (rows < hi) & (o_r < n_rows))[:, None] & m_d[None, :]
    return tl.load(p + rows.to(tl.int64)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(ACC)


@triton.jit
def _pre(xn, xc, wt, b, W: tl.constexpr, WP: tl.constexpr, HP: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
         HAS_BIAS: tl.constexpr):
    """bias + sum_k weight[W-1-k] * x[u-k] for the R rows u = g + i; xn holds x at rows
    g-(W-1) .. g+R-W, xc at g+R-(W-1) .. g+R-1 (rows outside the sequence already zero)."""
    pre = _take(xn, xc, W - 1, R, R, W - 1, HP, R, R, BD) * _row(wt, WP, W - 1)[None, :]
    if HAS_BIAS:
        pre += b[None, :]
    for k in tl.static_range(1, W):
        pre += _take(xn, xc, W - 1 - k, R, R, W - 1, HP, R, R, BD) * _row(wt, WP, W - 1 - k)[None, :]
    return pre


@triton.jit
def _dpre(xn, xc, dp, wt, b, W: tl.constexpr, WP: tl.constexpr, HP: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
          HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The gradient before the activation, from dy (dp) and the recomputed pre-activation."""
    if SILU:
        pre = _pre(xn, xc, wt, b, W, WP, HP, R, BD, HAS_BIAS)
        sig = tl.sigmoid(pre)
        dp = dp * sig * (1.0 + pre * (1.0 - sig))
    return dp


@triton.jit
def causal_conv1d_fwd_segment_kernel(x, weight, bias, y, cu_seqlens, n_iter, N, T, D: tl.constexpr, W: tl.constexpr,
                                     WP: tl.constexpr, HP: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
                                     BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                                     STAGES: tl.constexpr, VEC: tl.constexpr):
    """Program (c, j): rows c*L .. c*L+L-1 of channel block j, one sequence's segment at a time."""
    c0 = tl.program_id(0) * L
    c_end = tl.minimum(c0 + L, T)
    o_r = tl.arange(0, R)
    o_h = tl.arange(0, HP)
    o_d = tl.program_id(1) * BD + _channels(BD, VEC)
    m_d = o_d < D
    wt, b = _weights(weight, bias, o_d, m_d, W, WP, BD, HAS_BIAS, ACC)
    s_first = _sequence_of_row(cu_seqlens, c0, n_iter, N)
    s_last = _sequence_of_row(cu_seqlens, c_end - 1, n_iter, N)
    for s in range(s_first, s_last + 1):
        start, end = _bounds(cu_seqlens, s, N, T)
        lo = tl.maximum(start, c0)
        hi = tl.minimum(end, c_end)
        n_steps = tl.cdiv(hi - lo, R)  # 0 for an empty sequence
        top = hi - R  # the first (highest) step; the last one may reach below lo (stored rows are masked)
        xc = _load(x, top + R - (W - 1), o_h, start, end, o_d, m_d, D, ACC, W - 1)
        for j in tl.range(0, n_steps, num_stages=STAGES):
            g = top - j * R
            xn = _load(x, g - (W - 1), o_r, start, end, o_d, m_d, D, ACC, R)
            out = _pre(xn, xc, wt, b, W, WP, HP, R, BD, HAS_BIAS)
            if SILU:
                out = out * tl.sigmoid(out)
            rows = g + o_r
            tl.store(y + rows.to(tl.int64)[:, None] * D + o_d[None, :], out.to(y.dtype.element_ty),
                     mask=(rows >= lo)[:, None] & m_d[None, :])
            xc = _take(xn, xc, 0, R, R, W - 1, HP, W - 1, HP, BD)


@triton.jit
def causal_conv1d_bwd_segment_kernel(x, weight, bias, dy, dx, part, cu_seqlens, n_iter, N, T, D: tl.constexpr,
                                     W: tl.constexpr, WP: tl.constexpr, HP: tl.constexpr, R: tl.constexpr,
                                     L: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                                     ACC: tl.constexpr, PS: tl.constexpr, NH: tl.constexpr, STAGES: tl.constexpr,
                                     VEC: tl.constexpr):
    """Program (c, j): rows c*L .. c*L+L-1 of channel block j. Per segment: NH = ceil((W-1)/R) halo
    steps above it (the pre-activation gradient of the W-1 rows after it, zero past the sequence's
    end), then its own rows. part[c] (PS values a row) gets this chunk's dweight ([D, W] flattened),
    then dbias. dx[u] = sum_s weight[W-1-s] * dpre[u+s]; dweight[W-1-k] = sum_u dpre[u] * x[u-k]."""
    i_c = tl.program_id(0)
    c0 = i_c * L
    c_end = tl.minimum(c0 + L, T)
    o_r = tl.arange(0, R)
    o_h = tl.arange(0, HP)
    o_w = tl.arange(0, WP)
    o_d = tl.program_id(1) * BD + _channels(BD, VEC)
    m_d = o_d < D
    wt, b = _weights(weight, bias, o_d, m_d, W, WP, BD, HAS_BIAS, ACC)
    dw_acc = tl.zeros([WP, BD], dtype=ACC)
    db_acc = tl.zeros([BD], dtype=ACC)
    s_first = _sequence_of_row(cu_seqlens, c0, n_iter, N)
    s_last = _sequence_of_row(cu_seqlens, c_end - 1, n_iter, N)
    for s in range(s_first, s_last + 1):
        start, end = _bounds(cu_seqlens, s, N, T)
        lo = tl.maximum(start, c0)
        hi = tl.minimum(end, c_end)
        n_steps = tl.cdiv(hi - lo, R)
        g0 = hi + (NH - 1) * R  # the first halo step
        xc = _load(x, g0 + R - (W - 1), o_h, start, end, o_d, m_d, D, ACC, W - 1)
        da = tl.zeros([HP, BD], dtype=ACC)  # dpre at rows g+R .. g+R+W-2
        for h in tl.static_range(NH):
            g = g0 - h * R
            xn = _load(x, g - (W - 1), o_r, start, end, o_d, m_d, D, ACC, R)
            dp = _dpre(xn, xc, _load(dy, g, o_r, lo, end, o_d, m_d, D, ACC, R), wt, b, W, WP, HP, R, BD, HAS_BIAS, SILU)
            xc = _take(xn, xc, 0, R, R, W - 1, HP, W - 1, HP, BD)
            da = _take(dp, da, 0, R, R, W - 1, HP, W - 1, HP, BD)
        for j in tl.range(0, n_steps, num_stages=STAGES):
            g = hi - R - j * R
            xn = _load(x, g - (W - 1), o_r, start, end, o_d, m_d, D, ACC, R)
            # rows below lo (the last step's overshoot) load no dy: zero dpre, nothing summed
            dp = _dpre(xn, xc, _load(dy, g, o_r, lo, end, o_d, m_d, D, ACC, R), wt, b, W, WP, HP, R, BD, HAS_BIAS, SILU)
            if HAS_BIAS:
                db_acc += tl.sum(dp, axis=0)
            for k in tl.static_range(W):
                part_k = tl.sum(dp * _take(xn, xc, W - 1 - k, R, R, W - 1, HP, R, R, BD), axis=0)
                # -0.0: x + -0.0 is x, so the rows not taken fold away once the row compare is constant
                dw_acc += tl.where(o_w[:, None] == W - 1 - k, part_k[None, :], -0.0)
            dxv = dp * _row(wt, WP, W - 1)[None, :]
            for t in tl.static_range(1, W):
                dxv += _take(dp, da, t, R, R, W - 1, HP, R, R, BD) * _row(wt, WP, W - 1 - t)[None, :]
            rows = g + o_r
            tl.store(dx + rows.to(tl.int64)[:, None] * D + o_d[None, :], dxv.to(dx.dtype.element_ty),
                     mask=(rows >= lo)[:, None] & m_d[None, :])
            xc = _take(xn, xc, 0, R, R, W - 1, HP, W - 1, HP, BD)
            da = _take(dp, da, 0, R, R, W - 1, HP, W - 1, HP, BD)
    row = part + i_c.to(tl.int64) * PS
    tl.store(row + o_d[None, :] * W + o_w[:, None], dw_acc, mask=(o_w < W)[:, None] & m_d[None, :])
    if HAS_BIAS:
        tl.store(row + D * W + o_d, db_acc, mask=m_d)
