"""Dtype policy and small helpers shared by our Triton kernels.

State and accumulation are fp32 (fp64 for fp64 inputs, which only the interpreter runs).
Matrix products take their operands in the input dtype, except under the CPU interpreter,
whose `tl.dot` mishandles bf16/fp16 (it multiplies the raw bit patterns): there the operands
are widened to fp32 instead. That is the only interpreter workaround, and it lives here.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _on_cuda() -> bool:
    if interpreting():
        return False
    try:
        return triton.runtime.driver.active.get_current_target().backend == "cuda"
    except Exception:  # noqa: BLE001 - no active driver: be conservative
        return False


@dataclass(frozen=True)
class Precision:
    """Constexpr dtypes passed to the kernels for one input dtype.

    acc: accumulators and recurrent state; dot: operand dtype of `tl.dot`; dot_precision:
    `input_precision` of products whose operands are fp32; solve_precision: the same for the
    triangular inverse inside a chunk, which needs near-fp32 accuracy whatever the inputs.
    """

    acc: object
    dot: object
    dot_precision: str | None
    solve_precision: str
    acc_torch: torch.dtype


def precision_for(dtype: torch.dtype) -> Precision:
    """The Precision of one input dtype, built once per dtype and mode (every kernel call asks)."""
    return _precision_for(dtype, interpreting())


@functools.cache
def _precision_for(dtype: torch.dtype, interpreted: bool) -> Precision:
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype {dtype}; expected one of float16, bfloat16, float32, float64")
    if dtype == torch.float64:
        return Precision(tl.float64, tl.float64, "ieee", "ieee", torch.float64)
    half = dtype in (torch.float16, torch.bfloat16)
    dot = tl.float32 if (half and interpreting()) else _TL_DTYPES[dtype]
    # The intra-chunk inverse takes fp32 operands. On NVIDIA: tf32x3 (fp32-accurate) for fp32 inputs;
    # tf32 for half inputs, still finer than the half cast its result gets before the next product,
    # and tf32x3 next to half-precision products in one kernel makes Triton 3.6 on Hopper emit code
    # that faults (illegal memory access). "ieee" is the portable fallback.
    if not _on_cuda():
        solve = "ieee"
    else:
        solve = "tf32" if half else "tf32x3"
    # For half operands the precision flag is meaningless: leave the backend's default.
    dot_precision = None if dot in (tl.float16, tl.bfloat16) else "ieee"
    return Precision(tl.float32, dot, dot_precision, solve, torch.float32)


def scale_arg(scale, prec: Precision, device) -> torch.Tensor:
    """The softmax-free attention scale as a one-element tensor in the accumulation dtype.

    Compiled Triton passes Python floats as fp32, which would cost fp64 runs their precision
    (0.7 is off by 2e-8 in fp32); a tensor keeps every dtype exact and needs no host sync.
    """
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=prec.acc_torch).reshape(1)
    return torch.full((1,), scale, dtype=prec.acc_torch, device=device)


def bwd_tuning(dtype: torch.dtype) -> dict:
    """Launch options of the backward kernels: fp32 tiles are twice the bytes of half ones, and at
    head dim 128 the pipelined loads overflow Hopper's 227 KiB of shared memory, so wide dtypes
    narrow the V block and do not pipeline."""
    if torch.empty((), dtype=dtype).element_size() >= 4:
        return {"block_v": 32, "num_stages": 1}
    return {"block_v": 64, "num_stages": 3}


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def head_block(n: int, dtype: torch.dtype, cap: int | None = None) -> int:
    """Tile width for a head dimension of size n (masked past n).

    Compiled half-precision products on tiles narrower than 64 fault on Hopper under Triton 3.6
    (illegal memory access, seen at head dim 16; 64 and 128 run), so half inputs pad to 64.
    That only costs anything at toy sizes.
    """
    b = next_pow2(n) if cap is None else min(cap, next_pow2(n))
    if dtype in (torch.float16, torch.bfloat16) and not interpreting():
        b = max(b, 64)
    return b


@triton.jit
def mm(a, b, DOT: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """a @ b with operands cast to DOT and the result accumulated in ACC."""
    return tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC, out_dtype=ACC)
