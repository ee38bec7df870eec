"""Stage 1: chunk-local cumulative sum of the log-decay g (restarting at every chunk).

Forward: G_t = sum of g over the chunk up to and including t. Backward: the reverse sum,
dg_t = sum of dG over the chunk from t to its end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import next_pow2, precision_for
from .varlen import Chunking


@triton.jit
def chunk_cumsum_kernel(x, y, cu_seqlens, chunk_indices, HV: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr):
    i_c = tl.program_id(0)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i_t = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    rows = bos + i_t * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m = (rows < eos)[:, None] & (o_h < HV)[None, :]
    offs = rows.to(tl.int64)[:, None] * HV + o_h[None, :]
    xv = tl.load(x + offs, mask=m, other=0.0).to(ACC)
    inclusive = tl.cumsum(xv, axis=0)
    if REVERSE:
        out = tl.sum(xv, axis=0)[None, :] - inclusive + xv
    else:
        out = inclusive
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=m)


def chunk_cumsum(x: torch.Tensor, chunking: Chunking, reverse: bool = False) -> torch.Tensor:
    """x: [T, HV]; returns the chunk-local (reverse when asked) cumulative sum in fp32 (fp64 for fp64)."""
    prec = precision_for(x.dtype)
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=prec.acc_torch, device=x.device)
    hv = x.shape[-1]
    chunk_cumsum_kernel[(chunking.num_chunks,)](
        x, y, chunking.cu_seqlens, chunking.chunk_indices, HV=hv, BT=chunking.chunk_size,
        BH=next_pow2(hv), REVERSE=reverse, ACC=prec.acc)
    return y
