"""Qwen3.5-MoE patch configs: Qwen3.5's bodies through a rename map, plus MoE-only bodies."""
