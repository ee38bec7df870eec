"""Qwen3.5 on Ascend NPUs (and any Triton backend): our portable Triton kernels."""

from patchgen.configs.qwen3_5.patches import dense_config

OP_DEFAULTS = {
    "gated_delta_rule": "triton",
    "causal_conv1d": "triton",
    "rms_norm_gated": "triton",
    "rms_norm": "torch",
    "attention": "sdpa",
    "cross_entropy": "chunked",
}

config = dense_config("npu", OP_DEFAULTS)
