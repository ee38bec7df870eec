"""Liger-Kernel (0.8) behind the rms_norm, rotary, swiglu_mlp and cross_entropy slots."""

from __future__ import annotations

import torch.nn.functional as F
from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.swiglu import LigerSiLUMulFunction
from liger_kernel.transformers.rope import liger_rotary_pos_emb

from .flce import chunk_mem_const, positional_arguments


def rms_norm(x, weight, eps):
    """Zero-centred RMSNorm: offset 1.0 and gemma casting (everything in fp32), as Qwen3.5's."""
    return LigerRMSNormFunction.apply(x, weight, eps, 1.0, "gemma", False)


def rotary(q, k, cos, sin):
    """Liger's RoPE; it infers the rotated width from cos, so partial rotary needs no slicing."""
    return liger_rotary_pos_emb(q, k, cos, sin)


def swiglu_mlp(x, gate_weight, up_weight, down_weight):
    """Projections by cuBLAS, the SiLU-multiply fused."""
    return F.linear(LigerSiLUMulFunction.apply(F.linear(x, gate_weight), F.linear(x, up_weight)), down_weight)


def cross_entropy(hidden, weight, labels, *, ignore_index=-100, return_entropy=False):
    """Liger's fused linear cross-entropy with per-token losses; it has no entropy output."""
    if return_entropy:
        raise NotImplementedError("the liger cross_entropy backend does not return entropy; use 'chunked'")
    arguments = positional_arguments(
        LigerFusedLinearCrossEntropyFunction.forward,
        _input=hidden,
        weight=weight,
        target=labels,
        ignore_index=ignore_index,
        reduction="none",
        chunk_mem_const=chunk_mem_const(hidden.shape[0], hidden.shape[1], weight.shape[0]),
    )
    loss = LigerFusedLinearCrossEntropyFunction.apply(*arguments)
    loss = loss[0] if isinstance(loss, tuple) else loss
    return loss.float(), None
