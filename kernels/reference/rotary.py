"""Rotary position embedding with partial rotary, as upstream's ``apply_rotary_pos_emb``."""

from __future__ import annotations

import torch


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary(q, k, cos, sin):
    """Rotate the first ``R = cos.shape[-1]`` dims of ``q, k: [B, H, T, D]``; the rest pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    width = cos.shape[-1]

    def apply(x):
        turned, kept = x[..., :width], x[..., width:]
        return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)

    return apply(q), apply(k)
