"""Packed-row metadata as the generated forwards read it from transformers' kwargs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .user_warning import warn_at_caller

PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class Varlen:
    """Boundaries of one packed row for the ``attention`` slot (``cu_seq_lens_*`` int32, max lengths as ints)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_attention(kwargs: dict) -> Varlen | None:
    """The packed-attention metadata in ``kwargs``, or None when the row is not packed.

    ``cu_seq_lens_k`` defaults to ``cu_seq_lens_q`` and the max lengths are read from the
    boundaries (one host sync) only when the caller did not pass them.
    """
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None:
        return None
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_k = cu_q if cu_k is None else cu_k
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    if max_k is None:
        max_k = max_q if cu_k is cu_q else (int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0)
    return Varlen(cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))


PACKED_ROW = "packed_row"  # the keyword a PackedRow travels under, from the text model to the mixers


@dataclass(frozen=True)
class PackedRow:
    """Recurrent-mixer metadata of one packed row, built once per micro-batch (one host copy).

    Passing `cu_seqlens_cpu` and `chunk_indices` to the GDN and conv slots spares every layer's calls a
    host sync to derive them from the device boundaries.
    """

    cu_seqlens: torch.Tensor  # [N + 1] int32, on the device
    cu_seqlens_cpu: torch.Tensor  # the same, on the host
    chunk_indices: torch.Tensor  # [chunks, 2] int32 on the device: (sequence, chunk within it)


def packed_row(
    kwargs: dict, batch: int, length: int, device: torch.device, host: torch.Tensor | None = None
) -> PackedRow | None:
    """The row's PackedRow: the one the top model put in ``kwargs``, else built here (None unpacked).

    ``host`` is a host copy of the boundaries the caller already made (spares a second sync).
    """
    row = kwargs.get(PACKED_ROW)
    if row is not None:
        return row
    cu = sequence_boundaries(kwargs, batch, length, device)
    if cu is None:
        return None
    from ..shared_prefix.gdn import chunk_indices

    host = cu.cpu() if host is None else host.to(torch.int32)
    chunks = torch.from_numpy(chunk_indices(host.diff().tolist()).astype("int32"))
    return PackedRow(cu, host, chunks.to(device, non_blocking=True))


def packed_max_lengths(kwargs: dict, row: PackedRow | None) -> dict:
    """`max_length_q/k` from the row's host boundaries when the caller did not pass them (no sync)."""
    if row is None or row.cu_seqlens_cpu.numel() < 2:
        return {}
    longest = int(row.cu_seqlens_cpu.diff().max())
    filled = {}
    if kwargs.get("max_length_q") is None:
        filled["max_length_q"] = longest
    cu_k = kwargs.get("cu_seq_lens_k")
    if kwargs.get("max_length_k") is None and (cu_k is None or cu_k is kwargs.get("cu_seq_lens_q")):
        filled["max_length_k"] = longest
    return filled


def sequence_boundaries(kwargs: dict, batch: int, length: int, device: torch.device) -> torch.Tensor | None:
    """``cu_seqlens`` of the ``[1, batch * length]`` row view a recurrent mixer runs on.

    A packed row gives its ``cu_seq_lens_q``; a batch of ``batch > 1`` rows becomes ``batch``
    sequences of one long row; one unpacked row needs no boundaries (None).
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q describes one packed row (batch 1), got batch {batch}")
        return cu.to(device=device, dtype=torch.int32)
    if batch == 1:
        return None
    return torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=device)


def without_packed(kwargs: dict) -> dict:
    """``kwargs`` minus the packed metadata (the shared-prefix plan replaces it below the top model)."""
    return {key: value for key, value in kwargs.items() if key not in PACKED_KWARGS and key != PACKED_ROW}


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None, ignore_index: int = -100) -> torch.Tensor:
    """``input_ids`` (or labels) shifted left by one, ``ignore_index`` at the last token of every sequence."""
    labels = torch.nn.functional.pad(input_ids[..., 1:], (0, 1), value=ignore_index)
    if cu_seqlens is not None and cu_seqlens.numel() > 2:
        # Last token of each sequence: cu - 1. A zero-length first sequence gives -1, so fill one slot
        # to the right of a spare leading column instead of filtering (filtering would sync).
        ends = cu_seqlens[1:-1].to(device=labels.device, dtype=torch.long)
        labels = torch.nn.functional.pad(labels, (1, 0), value=ignore_index).index_fill(-1, ends, ignore_index)
        labels = labels[..., 1:]
    return labels


class AttentionDropoutUnapplied(UserWarning):
    """A training forward on a packed row with ``attention_dropout > 0``: the varlen attention slot applies none."""


_dropout_warned = False


def warn_dropout_unapplied(rate: float) -> None:
    """Once per process: the packed row's attention (the varlen slot, shared prefixes too) runs without the config's
    ``attention_dropout``, flag on or off (every published Qwen3.5 config has 0.0; TRL's ``disable_dropout`` leaves
    this rate as it is)."""
    global _dropout_warned
    if _dropout_warned:
        return
    _dropout_warned = True
    warn_at_caller(
        f"attention_dropout={rate} is not applied on packed rows: their attention runs through the varlen attention "
        "slot, which has no dropout (unpacked rows keep transformers' attention, which applies it). Set "
        "config.attention_dropout = 0.0 to train packed rows as they run, or train unpacked rows for attention dropout",
        AttentionDropoutUnapplied,
    )
