"""``torch_npu.npu_swiglu`` (Ascend) behind the swiglu_mlp slot."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch_npu

from .npu_dtypes import require_npu_float


def swiglu_mlp(x, gate_weight, up_weight, down_weight):
    """``down(silu(gate(x)) * up(x))`` with one GEMM for gate and up and the SiLU-multiply fused.

    ``npu_swiglu(h, dim=-1)`` activates the *first* half of ``h``, so the gate rows go first.
    """
    require_npu_float("npu_swiglu", "swiglu_mlp", x)
    hidden = F.linear(x, torch.cat((gate_weight, up_weight), dim=0))
    return F.linear(torch_npu.npu_swiglu(hidden, dim=-1), down_weight)
