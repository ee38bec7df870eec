"""Generated Qwen3.5 modules."""
