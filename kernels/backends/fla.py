"""flash-linear-attention (fla-core 0.6) behind the gated_delta_rule, causal_conv1d and rms_norm_gated slots."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d
from fla.modules.causal_conv1d import causal_conv1d_bwd as _fla_conv_bwd
from fla.modules.causal_conv1d import causal_conv1d_fwd as _fla_conv_fwd
from fla.modules.norm.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
from fla.modules.norm.l2norm import l2norm_bwd as _fla_l2norm_bwd
from fla.modules.norm.l2norm import l2norm_fwd as _fla_l2norm_fwd
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd as _fla_gdn_bwd
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd as _fla_gdn_fwd


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
):
    """fla's chunked GDN; pass ``cu_seqlens_cpu`` and ``chunk_indices`` to spare it a host sync."""
    o, final = _fla_chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
    )
    return o, (final if output_final_state else None)


def causal_conv1d(x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None):
    """fla's varlen depthwise conv (Triton backend); the final conv state is dropped.

    ``initial_state: [N, W-1, D]`` (the slot's layout, rows in time order) goes to fla as its
    ``[N, D, W]`` (slot 0 unread); fla returns its gradient.
    """
    if initial_state is not None:
        initial_state = F.pad(initial_state.transpose(1, 2), (1, 0))
    y, _ = _fla_causal_conv1d(
        x, weight, bias, activation=activation, cu_seqlens=cu_seqlens, initial_state=initial_state
    )
    return y


def _on(device: torch.device):
    """fla launches on the current CUDA device, as its own guard ensures (nothing to set on the CPU interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _LookBack:
    """fla's conv forward and backward for `shared_prefix.conv.LookBackConv`, with the plan's chunk
    table (no per-call chunk indices); the state in fla's own layout `[N, D, W]`, slot 0 unread."""

    layout = "fla"

    def forward(self, x, weight, bias, state, idx, activation):
        with _on(x.device):
            y, _ = _fla_conv_fwd(
                x=x, weight=weight, bias=bias, residual=None, initial_state=state, output_final_state=False,
                activation=activation, cu_seqlens=idx.segment_cu, chunk_indices=idx.segment_chunks,
            )
        return y

    def backward(self, x, weight, bias, state, dy, idx, activation):
        with _on(x.device):
            dx, dweight, dbias, _, dstate = _fla_conv_bwd(
                x=x, dy=dy, dht=None, weight=weight, bias=bias, residual=None, initial_state=state,
                activation=activation, cu_seqlens=idx.segment_cu, chunk_indices=idx.segment_chunks,
            )
        return dx, dweight, dbias, dstate


causal_conv1d.look_back = _LookBack()


def rms_norm_gated(x, gate, weight, eps):
    """fla's fused ``weight * norm(x) * silu(gate)``; ``eps`` is passed through (fla's module default is 1e-5)."""
    return _fla_rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)


class _Rounds:
    """fla's forward and backward stages for `shared_prefix.gdn_rounds` (the functions its autograd
    Function calls, with the plan's chunk indices and no per-call validation)."""

    def l2norm_fwd(self, x):
        return _fla_l2norm_fwd(x)

    def l2norm_bwd(self, y, rstd, dy, dtype):
        return _fla_l2norm_bwd(y, rstd, dy).to(dtype)

    def forward(self, q, k, v, g, beta, scale, h0, rnd):
        with torch.cuda.device(q.device):  # fla launches on the current device, as its own guard ensures
            return self._forward(q, k, v, g, beta, scale, h0, rnd)

    def backward(self, q, k, v, g, beta, scale, h0, saved, do, dht, rnd):
        with torch.cuda.device(q.device):
            return self._backward(q, k, v, g, beta, scale, h0, saved, do, dht, rnd)

    def _forward(self, q, k, v, g, beta, scale, h0, rnd):
        g_cum, o, A, final, _, _ = _fla_gdn_fwd(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0,
            output_final_state=rnd.export_state, cu_seqlens=rnd.cu_seqlens, chunk_indices=rnd.chunk_indices,
        )
        return o.to(v.dtype), final, (g_cum, A)

    def _backward(self, q, k, v, g, beta, scale, h0, saved, do, dht, rnd):
        g_cum, A = saved
        dq, dk, dv, db, dg, dh0, _, _ = _fla_gdn_bwd(
            q=q, k=k, v=v, g=g_cum, beta=beta, A=A, scale=scale, initial_state=h0, do=do, dht=dht,
            cu_seqlens=rnd.cu_seqlens, chunk_indices=rnd.chunk_indices,
        )
        return dq, dk, dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype), dh0


gated_delta_rule.rounds = _Rounds()
