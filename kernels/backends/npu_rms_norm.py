"""``torch_npu.npu_rms_norm`` (Ascend) behind the rms_norm slot."""

from __future__ import annotations

import torch_npu

from .npu_dtypes import require_npu_float


def rms_norm(x, weight, eps):
    """Qwen3.5's zero-centred RMSNorm: gamma is ``1 + weight``, computed in fp32, cast back to x's dtype.

    The operator wants gamma in x's dtype; going through fp32 keeps upstream's rounding (the norm and
    ``1 + weight`` in fp32, one cast at the end) rather than rounding ``1 + weight`` to bf16.
    """
    require_npu_float("npu_rms_norm", "rms_norm", x)
    y, _rstd = torch_npu.npu_rms_norm(x.float(), 1.0 + weight.float(), epsilon=float(eps))
    return y.to(x.dtype)
