"""Generated Qwen3.5-MoE modules."""
