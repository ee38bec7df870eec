"""Varlen metadata for the chunked gated delta rule, computed once per call (or once per plan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 64


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
    cu = cu_seqlens.to(torch.int32)
    num_seqs = cu.numel() - 1
    if chunk_indices is None:
        host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu.cpu()  # the one host sync
        lengths = (host[1:] - host[:-1]).tolist()
        chunk_indices = chunk_indices_from_lengths(lengths, chunk_size).to(device, non_blocking=True)
    chunk_indices = chunk_indices.to(device=device, dtype=torch.int32).contiguous()
    counts = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
    chunk_offsets = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    chunk_offsets[1:] = torch.cumsum(counts, 0)
    return Chunking(cu.contiguous(), chunk_indices, chunk_offsets, num_seqs, chunk_indices.shape[0], chunk_size)
