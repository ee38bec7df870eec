"""Liger-Kernel (0.8) behind the rms_norm, rotary, swiglu_mlp and cross_entropy slots."""

from __future__ import annotations

import torch.nn.functional as F
from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.swiglu import LigerSiLUMulFunction
from liger_kernel.transformers.rope import liger_rotary_pos_emb

from .flce import chunk_mem_const, positional_arguments


def rms_norm(x, weight, eps):
    """Zero-centred RMSNorm: offset 1.0 and gemma casting (everything in fp32), as Qwen3.5's.

    `row_mode=True`: one row per program whatever the row count. Left to itself liger switches to a
    16-row block kernel at 32768 rows when the width is at most 256 (q_norm and k_norm over the head
    dim), whose reduction rounds differently in bf16, so a token's k_norm would depend on how many
    tokens share its call: a shared-prefix step (C rows) would then depart from packed (T rows)."""
    return LigerRMSNormFunction.apply(x, weight, eps, 1.0, "gemma", False, True)


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
