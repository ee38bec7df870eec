"""``torch_npu.npu_rotary_mul`` (Ascend) behind the rotary slot."""

from __future__ import annotations

import torch
import torch_npu

from .npu_dtypes import require_npu_float


def rotary(q, k, cos, sin):
    """Rotate the first ``R = cos.shape[-1]`` dims of ``q, k: [B, H, T, D]`` (half mode); the rest pass through.

    The operator rotates its whole last dim, so Qwen3.5's partial rotary slices the rotated part out
    and puts the untouched part back. Layout BNSD with cos/sin as ``[B, 1, T, R]``. ``rotary_mode`` is
    left at its default, ``"half"`` (rotate_half), which older torch_npu releases lack as an argument.
    """
    require_npu_float("npu_rotary_mul", "rotary", q, k)
    cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
    width = cos.shape[-1]

    def apply(x):
        if width == x.shape[-1]:
            return torch_npu.npu_rotary_mul(x.contiguous(), cos, sin)
        turned = torch_npu.npu_rotary_mul(x[..., :width].contiguous(), cos, sin)
        return torch.cat((turned, x[..., width:]), dim=-1)

    return apply(q), apply(k)
