"""Qwen3.5 on Ascend NPUs: torch_npu's fused operators where it has one, our portable Triton kernels for the rest."""

from patchgen.configs.qwen3_5.patches import dense_config

OP_DEFAULTS = {
    "gated_delta_rule": "triton",
    "causal_conv1d": "triton",
    "rms_norm_gated": "triton",
    "rms_norm": "npu_rms_norm",
    "rotary": "npu_rotary_mul",
    "swiglu_mlp": "npu_swiglu",
    "attention": "npu_fusion_attention",
    "cross_entropy": "chunked",
}

config = dense_config("npu", OP_DEFAULTS)
