"""FlashAttention 2 (``flash_attn``) behind the attention slot."""

from __future__ import annotations

from flash_attn import flash_attn_varlen_func


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal=True):
    """Varlen FA2; GQA native, causal aligned bottom-right."""
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=causal
    )
