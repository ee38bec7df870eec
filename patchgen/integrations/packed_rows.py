"""Padded trainer rows ``[B, L]`` to one packed row ``[1, T]`` and per-token values back.

RL trainers score ``prompt + completion`` rows left-padded on the prompt and right-padded on the
completion, with the completion in the last ``K`` columns. One packed row of the real tokens lets a
patchgen model with ``shared_prefix_training`` compute each prompt once; the values it returns per
packed position are put back where the trainer expects them (``[B, K]``, 0 where nothing is scored).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from patchgen.kernels.modeling.host_rows import queue_upload

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedRows:
    """One packed row built from padded rows, and where its scored positions go in ``[B, K]``.

    The row (ids, boundaries, labels) is on the host: a patchgen model uploads it itself and plans from
    that copy (`patchgen.kernels.modeling.host_rows`), so a scoring loop never waits for the device before
    it queues the next micro-batch. The scatter indices are on the device the values come back on.
    """

    input_ids: torch.Tensor  # [1, T], host
    cu_seqlens: torch.Tensor  # [N + 1] int32, host (rows without a token are left out)
    shift_labels: torch.Tensor  # [1, T], host: the next token where it is a completion token, else -100
    scored_at: torch.Tensor  # [S] packed positions whose next token is scored, on the device
    out_rows: torch.Tensor  # [S] row in [B, K] of each scored position, on the device
    out_cols: torch.Tensor  # [S] column in [B, K], on the device
    batch: int
    keep: int
    longest: int

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def model_kwargs(self) -> dict:
        cu = self.cu_seqlens
        return dict(
            input_ids=self.input_ids, shift_labels=self.shift_labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
            max_length_q=self.longest, max_length_k=self.longest,
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per packed position ``[1, T]`` to the trainer's ``[B, K]`` layout (0 where nothing is scored); by index,
        with no host sync (a boolean mask would count its rows on the host)."""
        picked = values[0].index_select(0, self.scored_at.to(values.device))
        out = picked.new_zeros(self.batch, self.keep)
        return out.index_put((self.out_rows.to(values.device), self.out_cols.to(values.device)), picked)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int, device=None) -> PackedRows | None:
    """Pack the real tokens of each row (``attention_mask == 1``); the last ``keep`` columns are scored.

    Works on the host (rows given on the device are copied once); the scatter indices go to ``device``
    (default: the device of ``input_ids``). Returns None when a row's real tokens are not one contiguous run
    (a mask with holes): packing would change what those tokens see, so the caller scores such a batch as it is.
    """
    device = input_ids.device if device is None else torch.device(device)
    ids = input_ids.detach().cpu()
    batch, length = ids.shape
    host = attention_mask.detach().to("cpu", torch.bool)
    lengths = host.sum(1)
    first = host.to(torch.int8).argmax(1)
    for b in range(batch):
        n = int(lengths[b])
        if n and not bool(host[b, int(first[b]) : int(first[b]) + n].all()):
            return None
    rows = torch.repeat_interleave(torch.arange(batch), lengths)
    starts = torch.repeat_interleave(first, lengths)
    offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    cols = starts + offsets
    next_cols = cols + 1
    ends = torch.repeat_interleave(first + lengths, lengths)
    scored = (next_cols < ends) & (next_cols >= length - keep)
    kept = lengths[lengths > 0]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), kept.cumsum(0)]).to(torch.int32)
    nxt = ids[rows, next_cols.clamp(max=length - 1)]
    shift_labels = torch.where(scored, nxt, torch.full_like(nxt, IGNORE_INDEX)).unsqueeze(0)
    return PackedRows(
        input_ids=ids[rows, cols].unsqueeze(0),
        cu_seqlens=cu,
        shift_labels=shift_labels,
        scored_at=queue_upload(scored.nonzero().squeeze(1), device),
        out_rows=queue_upload(rows[scored], device),
        out_cols=queue_upload(next_cols[scored] - (length - keep), device),
        batch=batch,
        keep=keep,
        longest=int(kept.max()) if kept.numel() else 0,
    )
