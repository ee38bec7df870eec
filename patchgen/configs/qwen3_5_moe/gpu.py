"""Qwen3.5-MoE on NVIDIA GPUs: Qwen3.5's patches renamed, plus the experts through ops.moe_experts."""

from patchgen.configs.qwen3_5 import gpu as dense
from patchgen.configs.qwen3_5_moe.patches import moe_config

config = moe_config(dense.config, {"moe_experts": "grouped_mm"})
