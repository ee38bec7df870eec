"""torch's own ``torch.nn.attention.varlen.varlen_attn`` (CUDA) behind the attention slot."""

from __future__ import annotations

import inspect

from torch.nn.attention.varlen import varlen_attn

# The keyword set changed across torch releases: 2.11 has no ``enable_gqa``.
_PARAMETERS = inspect.signature(varlen_attn).parameters
_NATIVE_GQA = "enable_gqa" in _PARAMETERS


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal=True):
    """Varlen flash attention shipped with torch; causal is the window ``(-1, 0)`` (bottom-right)."""
    extra = {}
    if "window_size" in _PARAMETERS:
        extra["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        extra["is_causal"] = causal
    group = q.shape[1] // k.shape[1]
    if group > 1 and _NATIVE_GQA:
        extra["enable_gqa"] = True
    elif group > 1:  # older torch: repeat the key/value heads (costs memory, not correctness)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, **extra)
