"""Qwen3.5-MoE on Ascend NPUs: Qwen3.5's patches renamed, plus the experts through ops.moe_experts."""

from patchgen.configs.qwen3_5 import npu as dense
from patchgen.configs.qwen3_5_moe.patches import moe_config

config = moe_config(dense.config, {"moe_experts": "npu_grouped_matmul"})
