"""SwiGLU MLP as upstream's ``Qwen3_5MLP``: ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import torch.nn.functional as F


def swiglu_mlp(x, gate_weight, up_weight, down_weight):
    """Bias-free SwiGLU MLP in x's dtype."""
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)
