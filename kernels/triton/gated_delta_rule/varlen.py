"""Varlen metadata for the chunked gated delta rule, computed once per call (or once per plan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._common import interpreting

CHUNK = 64


@triton.jit
def chunk_offsets_kernel(cu_seqlens, out, N, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """out[0] = 0, out[n+1] = sum over sequences j <= n of ceil(length_j / CHUNK): one launch in place
    of the slices, arithmetic, zeros, cumsum and copy that the host issued before."""
    carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    tl.store(out, carry)
    for s in range(0, N, BLOCK):
        i = s + tl.arange(0, BLOCK)
        m = i < N
        count = (tl.load(cu_seqlens + i + 1, mask=m, other=0) - tl.load(cu_seqlens + i, mask=m, other=0)
                 + CHUNK - 1) // CHUNK
        tl.store(out + 1 + i, tl.cumsum(count, axis=0) + carry, mask=m)
        carry += tl.sum(count, axis=0)


@dataclass(frozen=True)
class Chunking:
    """How a packed row splits into sequences and 64-token chunks.

    cu_seqlens: int32 [N+1] on the device; chunk_indices: int32 [NT, 2] rows of
    (sequence, chunk within sequence), the layout flash-linear-attention uses; chunk_offsets:
    int32 [N+1], the first global chunk of each sequence. Chunks restart at every sequence start.
    """

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    num_seqs: int
    num_chunks: int
    chunk_size: int = CHUNK


def chunk_indices_from_lengths(lengths: list[int], chunk_size: int = CHUNK) -> torch.Tensor:
    rows = [(n, i) for n, length in enumerate(lengths) for i in range(-(-length // chunk_size))]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)


def make_chunking(
    cu_seqlens: torch.Tensor,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_size: int = CHUNK,
) -> Chunking:
    """Build the chunk tables; with `chunk_indices` or `cu_seqlens_cpu` given, without a host sync."""
    device = cu_seqlens.device
    cu = cu_seqlens.to(torch.int32).contiguous()
    num_seqs = cu.numel() - 1
    if chunk_indices is None:
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu.cpu()  # the one host sync
        lengths = (host[1:] - host[:-1]).tolist()
        chunk_indices = chunk_indices_from_lengths(lengths, chunk_size).to(device, non_blocking=True)
    chunk_indices = chunk_indices.to(device=device, dtype=torch.int32).contiguous()
    if device.type == "cpu" and not interpreting():  # no Triton here: the same sums in torch
        chunk_offsets = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
        chunk_offsets[1:] = torch.cumsum((cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size, 0)
    else:
        chunk_offsets = torch.empty(num_seqs + 1, dtype=torch.int32, device=device)
        chunk_offsets_kernel[(1,)](cu, chunk_offsets, num_seqs, CHUNK=chunk_size, BLOCK=1024)
    return Chunking(cu, chunk_indices, chunk_offsets, num_seqs, chunk_indices.shape[0], chunk_size)
