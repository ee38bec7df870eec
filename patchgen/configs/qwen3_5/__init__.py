"""Qwen3.5 patch configs and their replacement bodies."""
