"""Depthwise causal conv1d over one packed row, varlen, optional SiLU; forward and backward.

y[t, d] = act(bias[d] + sum_w weight[d, w] * x[t - (W-1) + w, d]), where rows before the start
of t's sequence read as zero (every sequence starts from a zero state). W is a kernel parameter.

Each row finds its sequence by a binary search over cu_seqlens inside the kernel, so a call costs
its launches and no tensor work on the host. Four designs, picked by `ConvTuning`:
- "segment" (causal_conv1d_segment.py, forward and backward): the window walk, split at sequence
  boundaries, so that the causal padding and sequence ends are masked loads and not per-element
  selects (the window kernels' step is bound by instruction issue, not memory).
- "window" (causal_conv1d_window.py, forward and backward): a program walks a chunk of rows, R at
  a time, carrying the rows it shares with the previous step in registers; every element crosses
  L1 once and the activation is evaluated once per element.
- "tile" forward: [BT, BD] tiles, x read at W shifted rows (L1 hits for all but one).
- "scratch" backward (CUDA): the pre-activation gradient computed once per row on tiles overlapping
  by W-1 rows and shifted through a per-program scratch tile in L2; "recompute" backward (portable):
  the pre-activation recomputed at the W shifted rows.
Weight and bias gradients are fp32 partial sums, one row per program (row), summed by one small
launch that writes the parameters' dtypes (`sum_partials`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import next_pow2, precision_for, search_steps, sequence_of, shape_cache_get, sum_partials
from .causal_conv1d_segment import causal_conv1d_bwd_segment_kernel, causal_conv1d_fwd_segment_kernel
from .causal_conv1d_state import CausalConv1dState
from .causal_conv1d_window import causal_conv1d_bwd_window_kernel, causal_conv1d_fwd_window_kernel
from .launch_config import config_from_env, table_config

_ACTIVATIONS = {None: False, "identity": False, "silu": True, "swish": True}


@triton.jit
def causal_conv1d_fwd_kernel(x, weight, bias, y, cu_seqlens, n_iter, N, T, D: tl.constexpr, W: tl.constexpr,
                             BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                             ACC: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    start = tl.load(cu_seqlens + sequence_of(cu_seqlens, o_t, m_t, n_iter, N), mask=m_t, other=0)
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
def causal_conv1d_bwd_kernel(x, weight, bias, dy, dx, partials, scratch, cu_seqlens, n_iter, N, T,
                             n_row_tiles, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                             BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                             ACC: tl.constexpr, PS: tl.constexpr):
    """Persistent over rows: program (p, c) takes the row tiles p, p + P, ... of channel block c.
    Tiles of BT rows overlap by W-1 rows; each computes dpre (the gradient before the activation,
    the pre-activation recomputed) on all BT rows and writes dx for the first BT-W+1:
    dx[t] = sum_s weight[W-1-s] * dpre[t+s] over rows of t's sequence; the same shifted dpre tiles
    times the unshifted x give the weight gradient (x is read W times per tile, not 2W). Weight and
    bias gradients are summed in registers and written once per program, into partials[program row]
    (PS values: dweight [D, W] flattened, then dbias), which only this row's programs write."""
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
        seq = sequence_of(cu_seqlens, o_t, m_t, n_iter, N)
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
            dw_s = tl.sum(tl.where(own_rows[:, None], shifted * x_here, 0.0), axis=0)
            dw_acc += tl.where(o_w[:, None] == W - 1 - s, dw_s[None, :], 0.0)
        tl.store(dx + o_t.to(tl.int64)[:, None] * D + o_d[None, :], dxv.to(dx.dtype.element_ty), mask=own)
    row = partials + i_p.to(tl.int64) * PS
    tl.store(row + o_d[None, :] * W + o_w[:, None], dw_acc, mask=(o_w < W)[:, None] & m_d[None, :])
    if HAS_BIAS:
        tl.store(row + D * W + o_d, db_acc, mask=m_d)


@triton.jit
def causal_conv1d_bwd_recompute_kernel(x, weight, bias, dy, dx, part, cu_seqlens, n_iter, N, T,
                                       D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                                       HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                                       PS: tl.constexpr):
    """The portable backward (no scratch, no barrier): dpre is recomputed at each of the W shifted
    rows that dx[t] = sum_s weight[W-1-s] * dpre[t+s] reads. Weight and bias gradients are written
    per block of rows and summed by the caller."""
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    seq = sequence_of(cu_seqlens, o_t, m_t, n_iter, N)
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
        tl.store(part + i_t.to(tl.int64) * PS + o_d * W + w, tl.sum(dpre_t * xv, axis=0), mask=m_d)
    if HAS_BIAS:
        tl.store(part + i_t.to(tl.int64) * PS + D * W + o_d, tl.sum(dpre_t, axis=0), mask=m_d)


@dataclass(frozen=True)
class ConvTuning:
    """Kernel designs, tile shapes and launch options; docs/triton_kernels.md says how they were chosen.

    fwd_kernel: "tile", "window" or "segment"; bwd_kernel: "window", "segment", "scratch" (CUDA only: it relies on a
    barrier making a program's global stores visible to its own threads, which CUDA's bar.sync does),
    "recompute", or None (scratch on CUDA and under the interpreter, recompute elsewhere).
    Window fields (also the segment design's): rows (R) per step, chunk (L, a multiple of R) rows per program, bd channels per
    program (at least 32 lanes x the vector width per warp keeps a step's rows inside one thread),
    stages: pipelining depth of the step loop (None or 1: not pipelined); fast: a step whose rows all
    have their W taps and W shifts inside their sequence skips the per-row masks (a branch per step;
    the segment design has no per-row masks, so it ignores fast); maxnreg: a cap on registers per
    thread for the window and segment kernels (Triton's CUDA launch option; None: the compiler's
    choice, which for these one-warp programs is all 255 and so 8 warps a multiprocessor); vec (segment
    only): channels a load takes together, at most (None: the compiler's 16-byte vectors); bd should be
    32 x vec x warps, so that a step's rows stay inside each thread.
    """

    fwd_kernel: str = "tile"
    fwd_bt: int = 32
    fwd_bd: int = 128
    fwd_warps: int = 4
    fwd_rows: int = 4
    fwd_chunk: int = 512
    fwd_stages: int | None = None
    fwd_fast: bool = False
    bwd_kernel: str | None = None
    bwd_bt: int = 64
    bwd_bd: int = 64
    bwd_warps: int = 4
    bwd_programs_per_sm: int = 8
    bwd_stages: int | None = None  # window: as fwd_stages; scratch: Triton's launch option (None: its default)
    bwd_rows: int = 4
    bwd_chunk: int = 512
    bwd_fast: bool = False
    fwd_maxnreg: int | None = None
    bwd_maxnreg: int | None = None
    fwd_vec: int | None = None
    bwd_vec: int | None = None
    recompute_bt: int = 32
    recompute_bd: int = 64


def _window(**kw) -> ConvTuning:
    base = dict(fwd_kernel="window", fwd_bd=256, fwd_warps=1, fwd_rows=4, fwd_chunk=512, fwd_stages=3,
                bwd_kernel="window", bwd_bd=256, bwd_warps=1, bwd_rows=4, bwd_chunk=512, bwd_stages=3)
    return ConvTuning(**{**base, **kw})


def _segment(**kw) -> ConvTuning:
    return _window(**{"fwd_kernel": "segment", "bwd_kernel": "segment", **kw})


# Candidates that bench/triton_tuning.py --sweep times; PATCHGEN_TRITON_CONV picks one for a process
# (a name, optionally followed by field=value overrides: "window,bwd_rows=8").
PRESETS = {
    "tile-scratch": ConvTuning(),  # measured best of the tile designs (2026-12-01, H200)
    "window": _window(),
    "window-fast": _window(fwd_fast=True, bwd_fast=True),
    "window-r2": _window(fwd_rows=2, bwd_rows=2),
    "window-c256": _window(fwd_chunk=256, bwd_chunk=256),
    "window-s2": _window(fwd_stages=2, bwd_stages=2),
    "window-nopipe": _window(fwd_stages=None, bwd_stages=None),
    "window-bd512-w2": _window(fwd_bd=512, fwd_warps=2, bwd_bd=512, bwd_warps=2),
    "tile-window": _window(fwd_kernel="tile", fwd_bt=32, fwd_bd=128, fwd_warps=4, fwd_stages=None),
    "window-scratch": _window(bwd_kernel=None, bwd_bd=64, bwd_warps=4, bwd_stages=None),
    "window-c256-fast": _window(fwd_chunk=256, bwd_chunk=256, fwd_fast=True, bwd_fast=True),
    # the segment design (causal_conv1d_segment.py); not a default until the sweep has timed it
    "segment": _segment(),
    "segment-c256": _segment(fwd_chunk=256, bwd_chunk=256),
    "segment-r2": _segment(fwd_rows=2, bwd_rows=2),
    "segment-bd512-w2": _segment(fwd_bd=512, fwd_warps=2, bwd_bd=512, bwd_warps=2),
    # 168 registers: 12 one-warp programs a multiprocessor instead of 8, for ~55 spilled registers a step
    # (in L1); 128: 16 programs, ~110 (counts from ptxas for sm_90)
    "segment-reg168": _segment(bwd_maxnreg=168),
    "segment-reg128": _segment(bwd_maxnreg=128),
    # 4 channels a thread (bf16: 8-byte loads): 128 registers without spills, 16 warps a multiprocessor
    "segment-v4": _segment(fwd_bd=128, fwd_vec=4, bwd_bd=128, bwd_vec=4, bwd_maxnreg=128),
    "segment-v4-c256": _segment(fwd_bd=128, fwd_vec=4, bwd_bd=128, bwd_vec=4, bwd_maxnreg=128, fwd_chunk=256,
                                bwd_chunk=256),
    "segment-v2": _segment(fwd_bd=64, fwd_vec=2, bwd_bd=64, bwd_vec=2),
    # no software pipelining: 40 instructions an element instead of 46 (no shared-memory staging and
    # buffer bookkeeping), the loads' latency left to the 16 warps a multiprocessor
    "segment-v4-s1": _segment(fwd_bd=128, fwd_vec=4, bwd_bd=128, bwd_vec=4, bwd_maxnreg=128, fwd_stages=None,
                              bwd_stages=None),
    "tile-segment": _segment(fwd_kernel="tile", fwd_bt=32, fwd_bd=128, fwd_warps=4, fwd_stages=None),
    "window-r8": _window(fwd_rows=8, bwd_rows=8),  # last: the largest unrolled code, the longest compile
}
DEFAULT = PRESETS["tile-scratch"]
# A process-wide choice (the environment variable, or a bench assigning it); None: per device, the
# tuning table's entry, else DEFAULT.
TUNING: ConvTuning | None = config_from_env("PATCHGEN_TRITON_CONV", PRESETS, None, "causal_conv1d launch")


def default_tuning(device: torch.device) -> ConvTuning:
    """The configuration a call on `device` gets when it passes none."""
    return TUNING or table_config("causal_conv1d", PRESETS, DEFAULT, device, "causal_conv1d launch")


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _row_programs(device: torch.device, per_sm: int, n_row_tiles: int, n_channel_blocks: int) -> int:
    """Programs per channel block of the persistent backward: about per_sm programs on every
    multiprocessor in all. The interpreter gets two, so that the tests run the loop over several tiles."""
    if device.type != "cuda":
        return min(n_row_tiles, 2)
    return max(1, min(n_row_tiles, per_sm * _sm_count(device) // n_channel_blocks))


def _stages(num_stages: int | None) -> dict:
    return {} if num_stages is None else {"num_stages": num_stages}


def _maxnreg(maxnreg: int | None) -> dict:
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def _window_shape(rows: int, chunk: int, T: int, W: int) -> tuple[int, int, int]:
    """(R, L, HP): rows a step, rows a program, carried rows. L is a multiple of R, cut to the power of
    two that covers T for short rows (L is a compile-time constant: a few values, not one per length)."""
    if rows < 1 or rows & (rows - 1) or chunk < rows:
        raise ValueError(f"window rows must be a power of two no larger than the chunk, got rows={rows}, chunk={chunk}")
    chunk = min(chunk // rows * rows, max(rows, next_pow2(T)))
    return rows, chunk, max(1, next_pow2(W - 1))


def _bwd_design(tuning: ConvTuning, device: torch.device) -> str:
    kernel = tuning.bwd_kernel or ("scratch" if device.type in ("cuda", "cpu") else "recompute")
    if kernel not in ("window", "segment", "scratch", "recompute"):
        raise ValueError(f"bwd_kernel must be 'window', 'segment', 'scratch' or 'recompute', got {kernel!r}")
    return kernel


@functools.lru_cache(maxsize=256)
def _fwd_launch(T, D, W, N, dtype, device, has_bias, silu, tuning):
    """(kernel, grid, constexpr keywords) of one forward: worked out once per shape, not per call."""
    prec = precision_for(dtype)
    common = dict(D=D, W=W, HAS_BIAS=has_bias, SILU=silu, ACC=prec.acc)
    if tuning.fwd_kernel in ("window", "segment"):
        R, L, HP = _window_shape(tuning.fwd_rows, tuning.fwd_chunk, T, W)
        BD = min(tuning.fwd_bd, next_pow2(D))
        meta = dict(common, WP=next_pow2(W), HP=HP, R=R, L=L, BD=BD, STAGES=tuning.fwd_stages or 1,
                    num_warps=tuning.fwd_warps, **_maxnreg(tuning.fwd_maxnreg))
        if tuning.fwd_kernel == "segment":
            return (causal_conv1d_fwd_segment_kernel, (triton.cdiv(T, L), triton.cdiv(D, BD)),
                    dict(meta, VEC=tuning.fwd_vec or 0), search_steps(N))
        return (causal_conv1d_fwd_window_kernel, (triton.cdiv(T, L), triton.cdiv(D, BD)),
                dict(meta, FAST=bool(tuning.fwd_fast)), search_steps(N))
    if tuning.fwd_kernel != "tile":
        raise ValueError(f"fwd_kernel must be 'tile', 'window' or 'segment', got {tuning.fwd_kernel!r}")
    BT, BD = tuning.fwd_bt, min(tuning.fwd_bd, next_pow2(D))
    return (causal_conv1d_fwd_kernel, (triton.cdiv(T, BT), triton.cdiv(D, BD)),
            dict(common, BT=BT, BD=BD, num_warps=tuning.fwd_warps), search_steps(N))


def conv_fwd(x, weight, bias, cu_seqlens, silu: bool, tuning: ConvTuning | None = None):
    T, D = x.shape
    N = cu_seqlens.shape[0] - 1
    kernel, grid, meta, n_iter = _fwd_launch(T, D, weight.shape[1], N, x.dtype, x.device, bias is not None, silu,
                                             tuning or default_tuning(x.device))
    y = torch.empty_like(x)
    kernel[grid](x, weight, bias, y, cu_seqlens, n_iter, N, T, **meta)
    return y


@functools.lru_cache(maxsize=256)
def _bwd_launch(T, D, W, N, dtype, device, has_bias, silu, tuning):
    """(kernel, grid, constexpr keywords, partial rows, partial row length, extra) of one backward."""
    prec = precision_for(dtype)
    design = _bwd_design(tuning, device)
    PS = D * W + (D if has_bias else 0)
    common = dict(D=D, W=W, HAS_BIAS=has_bias, SILU=silu, ACC=prec.acc, PS=PS)
    if design in ("window", "segment"):
        R, L, HP = _window_shape(tuning.bwd_rows, tuning.bwd_chunk, T, W)
        BD = min(tuning.bwd_bd, next_pow2(D))
        n_chunks = triton.cdiv(T, L)
        meta = dict(common, WP=next_pow2(W), HP=HP, R=R, L=L, BD=BD, NH=triton.cdiv(W - 1, R),
                    STAGES=tuning.bwd_stages or 1, num_warps=tuning.bwd_warps, **_maxnreg(tuning.bwd_maxnreg))
        if design == "segment":
            return (design, causal_conv1d_bwd_segment_kernel, (n_chunks, triton.cdiv(D, BD)),
                    dict(meta, VEC=tuning.bwd_vec or 0), n_chunks, search_steps(N), None)
        return (design, causal_conv1d_bwd_window_kernel, (n_chunks, triton.cdiv(D, BD)),
                dict(meta, FAST=bool(tuning.bwd_fast)), n_chunks, search_steps(N), None)
    if design == "recompute":
        BT, BD = tuning.recompute_bt, min(tuning.recompute_bd, next_pow2(D))
        nt = triton.cdiv(T, BT)
        return (design, causal_conv1d_bwd_recompute_kernel, (nt, triton.cdiv(D, BD)), dict(common, BT=BT, BD=BD),
                nt, search_steps(N), None)
    BT, BD = max(tuning.bwd_bt, next_pow2(2 * W)), min(tuning.bwd_bd, next_pow2(D))
    n_row_tiles = triton.cdiv(T, BT - W + 1)
    n_d = triton.cdiv(D, BD)
    P = _row_programs(device, tuning.bwd_programs_per_sm, n_row_tiles, n_d)
    return (design, causal_conv1d_bwd_kernel, (P, n_d),
            dict(common, WP=next_pow2(W), BT=BT, BD=BD, num_warps=tuning.bwd_warps, **_stages(tuning.bwd_stages)),
            P, search_steps(N), (n_row_tiles, (P * n_d, BT, BD)))


def conv_bwd(x, weight, bias, dy, cu_seqlens, silu: bool, tuning: ConvTuning | None = None):
    """(dx, dweight, dbias or None)."""
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.shape[0] - 1
    design, kernel, grid, meta, n_part, n_iter, extra = _bwd_launch(T, D, W, N, x.dtype, x.device, bias is not None,
                                                                    silu, tuning or default_tuning(x.device))
    dx = torch.empty_like(x)
    part = torch.empty(n_part, meta["PS"], dtype=torch.float64 if x.dtype == torch.float64 else torch.float32,
                       device=x.device)
    if design == "scratch":
        n_row_tiles, scratch_shape = extra
        scratch = torch.empty(scratch_shape, dtype=part.dtype, device=x.device)
        kernel[grid](x, weight, bias, dy, dx, part, scratch, cu_seqlens, n_iter, N, T, n_row_tiles, **meta)
    else:
        kernel[grid](x, weight, bias, dy, dx, part, cu_seqlens, n_iter, N, T, **meta)
    dweight = torch.empty_like(weight)
    dbias = None if bias is None else torch.empty_like(bias)
    sum_partials(part, dweight, dbias)
    return dx, dweight, dbias


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
        dx, dweight, dbias = conv_bwd(x, weight, bias, dy if dy.is_contiguous() else dy.contiguous(), cu_seqlens,
                                      ctx.silu)
        return dx, dweight, dbias, None, None


_BATCH_CU_SEQLENS: dict = {}


def _batch_cu_seqlens(B: int, T: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens of B rows of T tokens, made once per (B, T, device); the kernels only read it."""
    return shape_cache_get(_BATCH_CU_SEQLENS, (B, T, device),
                           lambda: torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device))


def causal_conv1d(x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None,
                  cu_seqlens_cpu=None, chunk_indices=None):
    """Depthwise causal conv over x [B, T, D] with weight [D, W]; varlen through cu_seqlens (B == 1);
    `initial_state [N, W-1, D]`: each sequence's W-1 input rows before its start (causal_conv1d_state.py).
    `cu_seqlens_cpu` and `chunk_indices` are the slot's sync-sparing extras: these kernels find each
    row's sequence on the device and need neither."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(map(str, _ACTIVATIONS))}, got {activation!r} "
            "(the GDN conv of Qwen3.5 takes its activation from config.hidden_act, silu in every "
            "published checkpoint; the conv backends fuse silu only: set hidden_act='silu')")
    B, T, D = x.shape
    if weight.shape[0] != D:
        raise ValueError(f"weight must be [{D}, W], got {tuple(weight.shape)}")
    if cu_seqlens is None:
        cu_seqlens = _batch_cu_seqlens(B, T, x.device)
    elif B != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1 (one packed row), got {B}")
    elif cu_seqlens.device != x.device:
        raise ValueError(f"cu_seqlens must be on x's device ({x.device}), got {cu_seqlens.device}: move it there "
                         f"once (the shared-prefix plan and packed_row keep a device copy)")
    elif cu_seqlens.dtype != torch.int32 or not cu_seqlens.is_contiguous():
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    if initial_state is not None:
        expected = (cu_seqlens.shape[0] - 1, weight.shape[1] - 1, D)
        if B != 1 or tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be [sequences, W-1, D] = {list(expected)} over one packed row "
                             f"(batch 1), got {list(initial_state.shape)} for x {list(x.shape)}")
        y = CausalConv1dState.apply(x.reshape(T, D).contiguous(), weight.contiguous(),
                                    None if bias is None else bias.contiguous(), initial_state.contiguous(),
                                    cu_seqlens, _ACTIVATIONS[activation])
        return y.view(B, T, D)
    y = CausalConv1d.apply(x.reshape(B * T, D).contiguous(), weight.contiguous(),
                           None if bias is None else bias.contiguous(), cu_seqlens, _ACTIVATIONS[activation])
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
