"""RMS norms of Qwen3.5, written as upstream's modules compute them (statistics in fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    """Qwen3.5's zero-centred RMSNorm: ``norm(x) * (1 + weight)`` in fp32, cast back to x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.to(out.dtype))).type_as(x)


def rms_norm_gated(x, gate, weight, eps):
    """``weight * norm(x) * silu(gate)`` as Qwen3.5's RMSNormGated: norm in fp32, cast, then gated in fp32."""
    dtype = x.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    xf = x.to(wide)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(dtype)
    out = out * F.silu(gate.to(wide))
    return out.to(dtype)
