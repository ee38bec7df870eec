"""``torch_npu.npu_grouped_matmul`` (Ascend) behind the moe_experts slot.

Routing is upstream's (the slot receives ``top_k_index`` / ``top_k_weights``); here the (token, slot)
pairs are sorted by expert exactly as the ``grouped_mm`` reference does, and each projection is one
grouped GEMM grouped along M (``group_type=0``) with cumulative row ends (``group_list_type=0``),
single tensors in and out (``split_item=3``). torch_npu documents this operator for inference, so
the backward is ours: the input gradient is the same grouped GEMM against the untransposed weight;
the weight gradient is one matmul per expert over its rows (one host read of the group sizes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch_npu

from .npu_dtypes import require_npu_float

MAX_GROUPS = 1024  # group_list holds at most 1024 groups


def _is_silu(act_fn) -> bool:
    return act_fn is F.silu or "silu" in type(act_fn).__name__.lower() or "silu" in getattr(act_fn, "__name__", "").lower()


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``ends[e-1]:ends[e]`` of ``x [M, K]`` times ``weight[e] [K, N]`` (``weight`` may be a transposed view)."""
    return torch_npu.npu_grouped_matmul(
        [x.contiguous()], [weight], group_list=ends, group_type=0, group_list_type=0, split_item=3
    )[0]


class GroupedMatmul(torch.autograd.Function):
    """``y = x @ weight[e]`` per row group, with a backward of our own."""

    @staticmethod
    def forward(ctx, x, weight, ends):
        ctx.save_for_backward(x, weight, ends)
        return grouped_matmul(x, weight, ends)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, ends = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_matmul(grad_y, weight.transpose(-2, -1), ends)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight)
            start = 0
            for expert, end in enumerate(ends.tolist()):
                if end > start:
                    grad_weight[expert] = x[start:end].transpose(0, 1) @ grad_y[start:end]
                start = end
        return grad_x, grad_weight, None


def moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn):
    """``sum_k w_k * down_e(act(gate_e x) * up_e x)``; SiLU goes through ``npu_swiglu`` (gate half first)."""
    require_npu_float("npu_grouped_matmul", "moe_experts", hidden, gate_up_proj, down_proj)
    experts, top_k = gate_up_proj.shape[0], top_k_index.shape[1]
    if experts > MAX_GROUPS:
        raise ValueError(
            f"npu_grouped_matmul takes at most {MAX_GROUPS} groups, the model has {experts} experts; "
            "use moe_experts='eager'"
        )
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // top_k
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device)
    ends = counts.index_add(0, flat, torch.ones_like(flat, dtype=torch.int64)).cumsum(0)
    # transformers' layout is [E, out, in]; the operator multiplies x [M, in] by weight [E, in, out].
    gate_up = GroupedMatmul.apply(hidden[token], gate_up_proj.transpose(-2, -1), ends)
    if _is_silu(act_fn):
        inner = torch_npu.npu_swiglu(gate_up, dim=-1)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        inner = act_fn(gate) * up
    y = GroupedMatmul.apply(inner, down_proj.transpose(-2, -1), ends)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(hidden).index_add(0, token, y.to(hidden.dtype))
