"""Depthwise causal convolution over a packed row that never reads across a sequence start.

Upstream's fallback convolves the whole row, so the first ``W - 1`` tokens of a sequence see the
end of the previous one; here each tap is masked by the token's position within its sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import compute_dtype, positions_in_sequence

ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d(x, weight, bias=None, *, activation="silu", cu_seqlens=None):
    """``y[t] = act(bias + sum_j weight[:, W-1-j] * x[t-j])`` over taps that stay inside t's sequence.

    ``x: [B, T, D]``, ``weight: [D, W]``; computed in fp32 (float64 for float64), returned in x's dtype.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs one packed row (batch 1), got batch {x.shape[0]}")
    length, width = x.shape[1], weight.shape[1]
    dtype = compute_dtype(x.dtype)
    xs, w = x.to(dtype), weight.to(dtype)
    position = positions_in_sequence(cu_seqlens, length, x.device)
    out = xs * w[:, width - 1]
    for lag in range(1, width):
        shifted = F.pad(xs, (0, 0, lag, 0))[:, :length]
        # A select, not a product with 0: NaN * 0 is NaN, and would carry one sequence's NaN into the next.
        inside = (position >= lag).unsqueeze(-1)
        out = out + torch.where(inside, shifted, 0.0) * w[:, width - 1 - lag]
    if bias is not None:
        out = out + bias.to(dtype)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)
