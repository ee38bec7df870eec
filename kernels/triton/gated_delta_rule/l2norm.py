"""Stage 0: L2-normalise q and k over the head dimension (transformers' l2norm, eps 1e-6).

y = x * rsqrt(sum(x^2) + eps); the backward is dx = r * (dy - y * <y, dy>) with r that rsqrt.
With grouped value heads the backward also sums dy over the GROUP value heads of each key head
(dq, dk come per value head from the chunk stages), so that sum costs no launch and no fp32
[T, H, K] tensor of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import next_pow2, precision_for

EPS = 1e-6


@triton.jit
def l2norm_fwd_kernel(x, y, rstd, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                      EPS: tl.constexpr, ACC: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    offs = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    xv = tl.load(x + offs, mask=m, other=0.0).to(ACC)
    r = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) + EPS)
    tl.store(y + offs, (xv * r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, r, mask=o_r < n_rows)


@triton.jit
def l2norm_bwd_kernel(y, rstd, dy, dx, n_rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                      ACC: tl.constexpr, GROUP: tl.constexpr):
    """dy holds GROUP consecutive rows per row of y (value heads of one key head), summed first."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    offs = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    yv = tl.load(y + offs, mask=m, other=0.0).to(ACC)
    dy_rows = o_r.to(tl.int64)[:, None] * GROUP * D + o_d[None, :]
    dyv = tl.load(dy + dy_rows, mask=m, other=0.0).to(ACC)
    for j in tl.static_range(1, GROUP):
        dyv += tl.load(dy + dy_rows + j * D, mask=m, other=0.0).to(ACC)
    r = tl.load(rstd + o_r, mask=o_r < n_rows, other=0.0).to(ACC)
    dxv = r[:, None] * (dyv - yv * tl.sum(yv * dyv, axis=1)[:, None])
    tl.store(dx + offs, dxv.to(dx.dtype.element_ty), mask=m)


def _rows_per_block(d: int) -> int:
    return max(1, min(64, 4096 // next_pow2(d)))


def l2norm_fwd(x: torch.Tensor, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise the last dimension; returns (y in x's dtype, rstd fp32 with one value per row)."""
    x = x.contiguous()
    d = x.shape[-1]
    n_rows = x.numel() // d
    prec = precision_for(x.dtype)
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=prec.acc_torch, device=x.device)
    br = _rows_per_block(d)
    l2norm_fwd_kernel[(triton.cdiv(n_rows, br),)](
        x, y, rstd, n_rows, D=d, BD=next_pow2(d), BR=br, EPS=eps, ACC=prec.acc)
    return y, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of the input given the normalised output y [..., G, D], its rstd and dy; dx in `dtype`.

    dy may carry a group axis more than y ([..., G * n, D] against [..., G, D], n consecutive rows per
    row of y: the value heads of a key head), which is summed over."""
    dy = dy.contiguous()
    d = y.shape[-1]
    n_rows = y.numel() // d
    group, rest = divmod(dy.numel(), y.numel())
    if rest or group < 1 or dy.shape[-1] != d or dy.shape[:-2] != y.shape[:-2]:
        raise ValueError(f"dy {tuple(dy.shape)} must be y's shape {tuple(y.shape)} with its heads axis a multiple "
                         f"of y's (value heads of each key head)")
    prec = precision_for(y.dtype)
    dx = torch.empty(y.shape, dtype=dtype, device=y.device)
    br = _rows_per_block(d)
    l2norm_bwd_kernel[(triton.cdiv(n_rows, br),)](
        y, rstd, dy, dx, n_rows, D=d, BD=next_pow2(d), BR=br, ACC=prec.acc, GROUP=group)
    return dx
