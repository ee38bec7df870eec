"""The dtypes torch_npu's fused operators compute in, checked before a call so the error says what to do."""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def require_npu_float(operator: str, slot: str, *tensors: torch.Tensor) -> None:
    """Raise a TypeError naming the operator, the dtype found and the fallback when a dtype is not served."""
    for tensor in tensors:
        if tensor.dtype not in FLOATS:
            raise TypeError(
                f"{operator} computes in float16, bfloat16 or float32, got {tensor.dtype}; "
                f"use the reference backend (ops_implementation.{slot}) for {tensor.dtype}"
            )
