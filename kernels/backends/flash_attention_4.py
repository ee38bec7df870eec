"""FlashAttention 4 (CuTeDSL, ``flash_attn.cute``) behind the attention slot."""

from __future__ import annotations

from flash_attn.cute import flash_attn_varlen_func


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal=True):
    """Varlen FA4; it returns ``(out, lse)``, only ``out`` is kept."""
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=causal,
    )
    return out[0] if isinstance(out, tuple) else out
