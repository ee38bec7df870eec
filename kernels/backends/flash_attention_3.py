"""FlashAttention 3 (Hopper build, module ``flash_attn_interface``) behind the attention slot."""

from __future__ import annotations

from flash_attn_interface import flash_attn_varlen_func


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal=True):
    """Varlen FA3; some releases return ``(out, lse)``, only ``out`` is kept."""
    out = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=causal
    )
    return out[0] if isinstance(out, tuple) else out
