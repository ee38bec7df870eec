"""A kernel Triton's interpreter runs and Triton's compiler refuses: compile_kernels.py --self-check
compiles it, so the tests see that the check can fail (the bug of causal_conv1d_state_bwd_kernel that
the interpreter let through and the H200 did not)."""

import triton
import triton.language as tl


@triton.jit
def two_shapes_across_an_if(x, y, n, BA: tl.constexpr, BB: tl.constexpr):
    """`part` is [BA] in one branch and [BB] in the other, and read in neither after the `if`."""
    if tl.program_id(0) < n:
        part = tl.load(x + tl.arange(0, BA))
        tl.store(y + tl.arange(0, BA), part * 2)
    else:
        part = tl.load(x + tl.arange(0, BB))
        tl.store(y + BA + tl.arange(0, BB), part * 3)


def launch(x, y, n: int, grid: int = 2):
    two_shapes_across_an_if[(grid,)](x, y, n, BA=32, BB=16)
