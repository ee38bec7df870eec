"""Plain PyTorch backends of every op slot: the correctness references, and the CPU path.

Each is differentiable by autograd and computes in float32 (float64 when given float64).
"""
