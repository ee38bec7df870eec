"""The autograd.Function tying the forward stages to the backward stages.

Forward:  [l2norm] -> cumsum(g) -> wy (A, w, u) -> chunk_state (h, v_new, final) -> chunk_output (o).
Backward: chunk_state again (h, v_new are recomputed rather than stored) -> chunk_state_bwd
(dh, du, dh0) -> chunk_output_bwd (dq, dk, dw, dG) -> wy_bwd (dk, dv, dbeta, dG) ->
reverse cumsum (dg) -> value heads summed onto key heads (inside the l2norm backward when there is one)
-> [l2norm backward].
"""

from __future__ import annotations

import torch

from .chunk_output import chunk_output_bwd, chunk_output_fwd
from .chunk_state import chunk_state_bwd, chunk_state_fwd
from .cumsum import chunk_cumsum
from .l2norm import l2norm_bwd, l2norm_fwd
from .transposes import transpose_tuning
from .varlen import Chunking
from .wy import wy_bwd, wy_fwd


def _sum_value_heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """[T, HV, K] per value head -> [T, H, K]: the reverse of repeat_interleave over heads."""
    T, HV, K = x.shape
    return x if HV == h else x.view(T, h, HV // h, K).sum(2)


def gdn_forward(q, k, v, g, beta, scale, initial_state, output_final_state, chunking: Chunking, block_v=None):
    gc = chunk_cumsum(g, chunking)
    A, w, u = wy_fwd(k, v, beta, gc, chunking, block_v=block_v)
    h, v_new, final = chunk_state_fwd(k, w, u, gc, chunking, initial_state=initial_state,
                                      output_final_state=output_final_state, block_v=block_v)
    o = chunk_output_fwd(q, k, gc, h, v_new, scale, chunking, out_dtype=v.dtype, block_v=block_v)
    return o, final, gc, A, w, u


def gdn_backward(q, k, v, g, beta, scale, initial_state, gc, A, w, u, do, dht, need_dh0, chunking: Chunking,
                 block_v=None, sum_value_heads: bool = True, dqk_dtype: torch.dtype | None = None):
    """Returns (dq, dk [T, H, K] fp32, dv, dg, dbeta [T, HV], dh0 or None); dq, dk per value head
    ([T, HV, K]) when `sum_value_heads` is False (the l2norm backward then sums them), and then in
    `dqk_dtype` when given (fp32 otherwise)."""
    H = q.shape[1]
    if sum_value_heads and dqk_dtype is not None:
        raise ValueError("dqk_dtype applies to per-value-head gradients only (sum_value_heads=False): "
                         "summed ones stay fp32")
    h, v_new, _ = chunk_state_fwd(k, w, u, gc, chunking, initial_state=initial_state, block_v=block_v)
    dh, du, dh0 = chunk_state_bwd(q, k, w, gc, do, scale, chunking, dht=dht, need_dh0=need_dh0, block_v=block_v)
    dq, dk, dw, dG = chunk_output_bwd(q, k, gc, h, dh, v_new, do, du, scale, chunking, block_v=block_v,
                                      dq_dtype=dqk_dtype)
    dk, dv, dbeta, dG = wy_bwd(k, v, beta, gc, A, dw, du, chunking, dk=dk, dg=dG, block_v=block_v,
                               dk_dtype=dqk_dtype)
    dg = chunk_cumsum(dG, chunking, reverse=True)
    if not sum_value_heads:
        return dq, dk, dv, dg, dbeta, dh0
    return _sum_value_heads(dq, H), _sum_value_heads(dk, H), dv, dg, dbeta, dh0


class ChunkGatedDeltaRule(torch.autograd.Function):
    """Inputs are unbatched and contiguous: q, k [T, H, K], v [T, HV, V], g, beta [T, HV]."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, chunking,
                block_v):
        q_in, k_in = q, k
        q_rstd = k_rstd = None
        if use_qk_l2norm:
            q, q_rstd = l2norm_fwd(q)
            k, k_rstd = l2norm_fwd(k)
        o, final, gc, A, w, u = gdn_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                                            chunking, block_v)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, gc, A, w, u, q_rstd, k_rstd)
        ctx.scale, ctx.chunking, ctx.block_v = scale, chunking, block_v
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.in_dtypes = (q_in.dtype, k_in.dtype)
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, gc, A, w, u, q_rstd, k_rstd = ctx.saved_tensors
        need_dh0 = initial_state is not None and ctx.needs_input_grad[6]
        # the l2norm backward is then the only reader of dq, dk per value head: the design may store them
        # in the input dtype (it sums them in fp32)
        half = ctx.use_qk_l2norm and transpose_tuning(q.device).half_dqk
        dq, dk, dv, dg, dbeta, dh0 = gdn_backward(
            q, k, v, g, beta, ctx.scale, initial_state, gc, A, w, u, do.contiguous(),
            None if dht is None else dht.contiguous(), need_dh0, ctx.chunking, ctx.block_v,
            sum_value_heads=not ctx.use_qk_l2norm, dqk_dtype=q.dtype if half else None)
        if ctx.use_qk_l2norm:  # dq, dk per value head: the l2norm backward sums them onto the key heads
            dq = l2norm_bwd(q, q_rstd, dq, ctx.in_dtypes[0])
            dk = l2norm_bwd(k, k_rstd, dk, ctx.in_dtypes[1])
        else:
            dq, dk = dq.to(ctx.in_dtypes[0]), dk.to(ctx.in_dtypes[1])
        if dh0 is not None:
            dh0 = dh0.to(initial_state.dtype)
        return dq, dk, dv, dg.to(g.dtype), dbeta.to(beta.dtype), None, dh0, None, None, None, None
