"""flash-linear-attention (fla-core 0.6) behind the gated_delta_rule, causal_conv1d and rms_norm_gated slots."""

from __future__ import annotations

from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d
from fla.modules.norm.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule


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


def causal_conv1d(x, weight, bias=None, *, activation="silu", cu_seqlens=None):
    """fla's varlen depthwise conv (Triton backend); the final conv state is dropped."""
    y, _ = _fla_causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens)
    return y


def rms_norm_gated(x, gate, weight, eps):
    """fla's fused ``weight * norm(x) * silu(gate)``; ``eps`` is passed through (fla's module default is 1e-5)."""
    return _fla_rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)
