"""Gated RMSNorm: weight * x * rsqrt(mean(x^2) + eps) * silu(gate), statistics in fp32.

One pass over the rows forward; the backward recomputes the normalised row from the stored rstd,
on a persistent grid that sums the weight gradient in registers (one fp32 partial row per program),
and one small launch sums the partial rows into the weight's dtype. So a forward + backward moves
the two kernels' bytes (x, gate, y; x, gate, dy, dx, dgate, plus rstd and the partials) and
nothing else: no casts, copies or torch reductions. Launch shapes are worked out once per shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import next_pow2, precision_for, sum_partials
from .launch_config import config_from_env, table_config


@triton.jit
def rms_norm_gated_fwd_kernel(x, gate, weight, y, rstd, n_rows, eps, D: tl.constexpr, BD: tl.constexpr,
                              BR: tl.constexpr, ACC: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < n_rows
    m = m_r[:, None] & (o_d < D)[None, :]
    offs = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    xv = tl.load(x + offs, mask=m, other=0.0).to(ACC)
    gv = tl.load(gate + offs, mask=m, other=0.0).to(ACC)
    wv = tl.load(weight + o_d, mask=o_d < D, other=0.0).to(ACC)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / D + eps)
    out = wv[None, :] * (xv * r[:, None]) * (gv * tl.sigmoid(gv))
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, r, mask=m_r)


@triton.jit
def rms_norm_gated_bwd_kernel(x, gate, weight, rstd, dy, dx, dgate, dweight_part, n_rows, n_blocks,
                              D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, ACC: tl.constexpr,
                              STAGES: tl.constexpr):
    """Persistent: program p takes row blocks p, p + P, ...; the weight gradient is summed in
    registers and written once per program. STAGES pipelines the loop's loads (Triton pipelines a
    loop without matrix products only when the loop itself asks; a launch's num_stages does not)."""
    pid = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    wv = tl.load(weight + o_d, mask=m_d, other=0.0).to(ACC)
    dw_acc = tl.zeros([BD], dtype=ACC)
    for blk in tl.range(pid, n_blocks, tl.num_programs(0), num_stages=STAGES):
        o_r = blk * BR + tl.arange(0, BR)
        m_r = o_r < n_rows
        m = m_r[:, None] & m_d[None, :]
        offs = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
        xv = tl.load(x + offs, mask=m, other=0.0).to(ACC)
        gv = tl.load(gate + offs, mask=m, other=0.0).to(ACC)
        dyv = tl.load(dy + offs, mask=m, other=0.0).to(ACC)
        r = tl.load(rstd + o_r, mask=m_r, other=0.0).to(ACC)
        n = xv * r[:, None]
        sig = tl.sigmoid(gv)
        act = gv * sig
        dn = dyv * wv[None, :] * act
        dxv = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
        dgv = dyv * wv[None, :] * n * sig * (1.0 + gv * (1.0 - sig))
        tl.store(dx + offs, dxv.to(dx.dtype.element_ty), mask=m)
        tl.store(dgate + offs, dgv.to(dgate.dtype.element_ty), mask=m)
        dw_acc += tl.sum(dyv * n * act, axis=0)
    tl.store(dweight_part + pid * D + o_d, dw_acc, mask=m_d)


@dataclass(frozen=True)
class NormTuning:
    """Elements per program and launch options; see docs/triton_kernels.md for how they were chosen."""

    fwd_elements: int = 2048
    fwd_warps: int = 4
    bwd_elements: int = 1024
    bwd_warps: int = 2
    bwd_programs_per_sm: int = 16
    bwd_stages: int | None = None  # pipelining depth of the persistent loop's loads; None or 1: not pipelined
    max_rows: int = 64  # rows a block at most (a GPU's registers)


# Candidates that bench/triton_tuning.py --sweep times; PATCHGEN_TRITON_NORM picks one for a process
# (a name, optionally followed by field=value overrides: "default,bwd_warps=4").
PRESETS = {
    "default": NormTuning(),  # measured best (2026-12-01, H200)
    "bwd-pipe2": NormTuning(bwd_stages=2),
    "bwd-pipe3": NormTuning(bwd_stages=3),
    "bwd-8sm": NormTuning(bwd_programs_per_sm=8),
    "bwd-2048-4w": NormTuning(bwd_elements=2048, bwd_warps=4, bwd_programs_per_sm=8),
    "fwd-4096": NormTuning(fwd_elements=4096),
    "bwd-512-1w": NormTuning(bwd_elements=512, bwd_warps=1, bwd_programs_per_sm=32),
}
DEFAULT = PRESETS["default"]
# Triton's interpreter (the CPU) runs a program's block as numpy arrays and costs milliseconds per program
# whatever its size: few, large blocks (the GPU module's gated norm on the CPU under TRITON_INTERPRET=1)
INTERPRETER = NormTuning(fwd_elements=1 << 17, bwd_elements=1 << 17, max_rows=4096)
# A process-wide choice (the environment variable, or a bench assigning it); None: per device, the
# tuning table's entry, else DEFAULT.
TUNING: NormTuning | None = config_from_env("PATCHGEN_TRITON_NORM", PRESETS, None, "rms_norm_gated launch")


def default_tuning(device: torch.device) -> NormTuning:
    """The configuration a call on `device` gets when it passes none."""
    fallback = INTERPRETER if device.type == "cpu" else DEFAULT
    return TUNING or table_config("rms_norm_gated", PRESETS, fallback, device, "rms_norm_gated launch")
_SM_COUNT: dict[int, int] = {}


def _rows_per_block(d: int, elements: int, max_rows: int) -> int:
    return max(1, min(max_rows, elements // next_pow2(d)))


def _programs(device: torch.device, per_sm: int, n_blocks: int) -> int:
    """Size of the persistent grid: per_sm programs on every CUDA multiprocessor (read once per
    device); two under the interpreter, so that the tests run the loop; one program per block on
    other backends, whose core count is not known here."""
    if device.type == "cpu":
        return min(n_blocks, 2)
    if device.type != "cuda":
        return n_blocks
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(n_blocks, per_sm * _SM_COUNT[index]))


@functools.lru_cache(maxsize=256)
def _fwd_launch(n_rows, D, dtype, tuning):
    br = _rows_per_block(D, tuning.fwd_elements, tuning.max_rows)
    return (triton.cdiv(n_rows, br),), dict(D=D, BD=next_pow2(D), BR=br, ACC=precision_for(dtype).acc,
                                            num_warps=tuning.fwd_warps)


def norm_fwd(x, gate, weight, eps, tuning: NormTuning | None = None):
    D = x.shape[-1]
    n_rows = x.numel() // D
    grid, meta = _fwd_launch(n_rows, D, x.dtype, tuning or default_tuning(x.device))
    y = torch.empty_like(x)
    rstd = torch.empty(n_rows, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    rms_norm_gated_fwd_kernel[grid](x, gate, weight, y, rstd, n_rows, eps, **meta)
    return y, rstd


@functools.lru_cache(maxsize=256)
def _bwd_launch(n_rows, D, dtype, device, tuning):
    br = _rows_per_block(D, tuning.bwd_elements, tuning.max_rows)
    n_blocks = triton.cdiv(n_rows, br)
    P = _programs(device, tuning.bwd_programs_per_sm, n_blocks)
    meta = dict(D=D, BD=next_pow2(D), BR=br, ACC=precision_for(dtype).acc, STAGES=tuning.bwd_stages or 1,
                num_warps=tuning.bwd_warps)
    return P, n_blocks, meta


def norm_bwd(x, gate, weight, rstd, dy, tuning: NormTuning | None = None):
    """(dx, dgate, dweight)."""
    D = x.shape[-1]
    n_rows = x.numel() // D
    P, n_blocks, meta = _bwd_launch(n_rows, D, x.dtype, x.device, tuning or default_tuning(x.device))
    dx = torch.empty_like(x)
    dgate = torch.empty_like(gate)
    dw_part = torch.empty(P, D, dtype=rstd.dtype, device=x.device)
    rms_norm_gated_bwd_kernel[(P,)](x, gate, weight, rstd, dy, dx, dgate, dw_part, n_rows, n_blocks, **meta)
    dweight = torch.empty_like(weight)
    sum_partials(dw_part, dweight)
    return dx, dgate, dweight


class RMSNormGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        y, rstd = norm_fwd(x, gate, weight, eps)
        ctx.save_for_backward(x, gate, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        dx, dgate, dweight = norm_bwd(x, gate, weight, rstd, dy if dy.is_contiguous() else dy.contiguous())
        return dx, dgate, dweight, None


def rms_norm_gated(x, gate, weight, eps):
    """weight * norm(x) * silu(gate) over the last dimension; returns x's dtype."""
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    return RMSNormGated.apply(x.contiguous(), gate.contiguous(), weight.contiguous(), float(eps))


def rms_norm_gated_reference(x, gate, weight, eps):
    """Naive PyTorch version, computed in fp32 (fp64 for fp64 inputs)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(acc) * n * F.silu(gate.to(acc))).to(x.dtype)
