"""Qwen3.5 on NVIDIA GPUs: flash-linear-attention, Liger and flash attention where installed."""

from patchgen.configs.qwen3_5.patches import dense_config

OP_DEFAULTS = {
    "gated_delta_rule": "fla",
    "causal_conv1d": "fla",
    # ours, not fla's: fla tunes its gated norm per row-count bucket and its configurations round some rows
    # apart, so shared (C rows) and packed (T) were bit-equal only when the tunings agreed (docs/kernel_selection.md)
    "rms_norm_gated": "triton",
    "rms_norm": "liger",
    "attention": "auto",
    "cross_entropy": "liger",
}

config = dense_config("gpu", OP_DEFAULTS)
