"""Liger-Kernel's fused MoE experts (SiLU only) behind the moe_experts slot."""

from __future__ import annotations

import torch.nn.functional as F
from liger_kernel.ops.fused_moe import LigerFusedMoEFunction


def _is_silu(act_fn) -> bool:
    if act_fn is F.silu:
        return True
    return "silu" in type(act_fn).__name__.lower() or "silu" in getattr(act_fn, "__name__", "").lower()


def moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn):
    """Liger's fused experts, which hard-code SiLU: any other activation is refused."""
    if not _is_silu(act_fn):
        raise NotImplementedError(
            f"the liger moe_experts backend computes SiLU only, got {act_fn!r}; use 'grouped_mm'"
        )
    return LigerFusedMoEFunction.apply(hidden, gate_up_proj, down_proj, top_k_index, top_k_weights)
