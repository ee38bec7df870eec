"""Qwen3.5 on NVIDIA GPUs: flash-linear-attention, Liger and flash attention where installed."""

from patchgen.configs.qwen3_5.patches import dense_config

OP_DEFAULTS = {
    "gated_delta_rule": "fla",
    "causal_conv1d": "fla",
    "rms_norm_gated": "fla",
    "rms_norm": "liger",
    "attention": "auto",
    "cross_entropy": "liger",
}

config = dense_config("gpu", OP_DEFAULTS)
