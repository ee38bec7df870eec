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


def shape_cache_get(cache: dict, key, build):
    """cache[key], built once by build() for tensors that depend on nothing but the key (shapes).

    A CUDA build is waited for once, so another stream may read it at once; nothing is cached while a
    CUDA graph is being captured (the graph, not the eager run, would fill the tensor); a build inside inference
    mode makes ordinary tensors (an inference tensor cannot be saved by a later training forward)."""
    got = cache.get(key)
    if got is not None:
        return got
    device = key[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return build()
    if len(cache) >= 256:  # many shapes (generation prefills): keep the cache small
        cache.clear()
    with torch.inference_mode(False):  # kept for later calls: a training forward may save it for backward
        got = cache[key] = build()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return got


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


@triton.jit
def sequence_of(cu_seqlens, rows, m_rows, n_iter, N):
    """Index of the sequence holding each of `rows`: the largest j < N with cu_seqlens[j] <= row
    (a binary search of n_iter = ceil(log2 N) steps, so a call needs no per-row table from the host)."""
    lo = tl.zeros_like(rows)
    hi = tl.zeros_like(rows) + (N - 1)
    for _ in range(n_iter):
        mid = (lo + hi + 1) // 2
        take = tl.load(cu_seqlens + mid, mask=m_rows, other=0) <= rows
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    return lo


def search_steps(num_seqs: int) -> int:
    """n_iter of `sequence_of` for num_seqs sequences."""
    return max(1, (num_seqs - 1).bit_length())


@triton.jit
def sum_partials_kernel(part, n_part, out_a, out_b, M_A: tl.constexpr, M: tl.constexpr, BP: tl.constexpr,
                        BM: tl.constexpr, ACC: tl.constexpr):
    """out[m] = sum_p part[p, m] over a [n_part, M] fp32 buffer, written in the outputs' dtypes:
    m < M_A to out_a[m], the rest to out_b[m - M_A] (a weight and a bias gradient in one launch)."""
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_m = o_m < M
    acc = tl.zeros([BP, BM], dtype=ACC)
    for p0 in tl.range(0, n_part, BP, num_stages=3):
        o_p = p0 + tl.arange(0, BP)
        acc += tl.load(part + o_p.to(tl.int64)[:, None] * M + o_m[None, :], mask=(o_p < n_part)[:, None] & m_m[None, :],
                       other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_a + o_m, total.to(out_a.dtype.element_ty), mask=o_m < M_A)
    if M > M_A:
        tl.store(out_b + (o_m - M_A), total.to(out_b.dtype.element_ty), mask=m_m & (o_m >= M_A))


@functools.lru_cache(maxsize=256)
def _sum_partials_launch(n_part: int, M: int, M_A: int, wide: bool):
    # a norm's weight (small M, thousands of partial rows): tall narrow tiles; a conv's: wide short ones
    BP, BM = (256, 32) if M <= 4096 else (32, 128)
    return (triton.cdiv(M, BM),), dict(M_A=M_A, M=M, BP=BP, BM=BM, ACC=tl.float64 if wide else tl.float32)


def sum_partials(part: torch.Tensor, out_a: torch.Tensor, out_b: torch.Tensor | None = None) -> None:
    """Sum the rows of part ([n_part, M], fp32) into out_a (the first out_a.numel() columns) and out_b."""
    n_part, M = part.shape
    grid, meta = _sum_partials_launch(n_part, M, out_a.numel(), part.dtype == torch.float64)
    sum_partials_kernel[grid](part, n_part, out_a, out_a if out_b is None else out_b, **meta)
