"""A packed row handed to a GPU model on the host: uploaded here, and planned from the copy it came in.

The shared-prefix plan groups sequences by their token ids, so it needs the ids (and the boundaries) on
the host. A row that arrives on the device is copied back, and that copy waits until the device has run
everything queued before it: in a scoring loop the host cannot build micro-batch k + 1's plan while the
device still runs micro-batch k, and the device idles while it does. A caller that packs on the host
(`patchgen.integrations.trl`'s trainer, a collator) passes the row there instead, and the top model's
forward uploads it (no wait: a host-to-device copy is queued) and reads the host copy it was given.
The host copy is the only copy: nothing can disagree with it.

Only a CPU row handed to a model whose embedding is elsewhere is uploaded; every other call is
returned as it came.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the packed row's keyword tensors that the forward reads on the model's device
ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "shift_labels", "seq_idx")


@dataclass(frozen=True)
class HostRow:
    """The host copies of an uploaded packed row (None: that part came on the device, or not at all).

    `labels` is kept only when no `shift_labels` came (the head reads `shift_labels` first, wherever it is).
    `positions_from_boundaries`: the caller gave no position_ids and the boundaries came on the host, so the
    forward derives its positions from them, and the plan derives the same on the host (`positions`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    cu_seq_lens_q: torch.Tensor | None
    labels: torch.Tensor | None = None
    shift_labels: torch.Tensor | None = None
    positions_from_boundaries: bool = False
    seq_idx: torch.Tensor | None = None

    def positions(self, device_positions: torch.Tensor | None) -> torch.Tensor | None:
        """The row's positions on the host for the plan: the host copy given, else those the forward derived
        from the host boundaries, else `device_positions` (the caller's, on the device: read back)."""
        if self.position_ids is not None:
            return self.position_ids
        if self.positions_from_boundaries and self.cu_seq_lens_q is not None:
            from ..shared_prefix import positions_from_cu_seqlens

            return positions_from_cu_seqlens(self.cu_seq_lens_q, self.input_ids.shape[-1])
        return device_positions


def _on_host(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def queue_upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) copied to `device` without the host waiting: from pinned memory the copy is
    queued on the stream, where a plain `.to(device)` synchronizes the stream first."""
    if device.type == "cpu":
        return tensor
    staged = tensor.pin_memory()
    if staged is tensor:
        # already pinned: `pin_memory()` hands back the caller's own buffer, and a caller refilling it before the
        # queued copy ran would give the device other data than the plan read; copy it into a fresh one
        staged = torch.empty_like(tensor, pin_memory=True).copy_(tensor)
    return staged.to(device, non_blocking=True)


def upload(model, input_ids, position_ids, attention_mask, labels, kwargs: dict):
    """``(input_ids, position_ids, attention_mask, labels, kwargs, host)``: the row's tensors on the model's
    device, and a `HostRow` of what came on the host (None when nothing was uploaded)."""
    if not _on_host(input_ids):
        return input_ids, position_ids, attention_mask, labels, kwargs, None
    device = model.get_input_embeddings().weight.device
    if device.type in ("cpu", "meta"):
        return input_ids, position_ids, attention_mask, labels, kwargs, None
    uploaded: dict[int, torch.Tensor] = {}

    def up(value):
        if not _on_host(value):
            return value
        # one upload per host tensor: cu_seq_lens_k given as cu_seq_lens_q stays the same tensor (checks read identity)
        if id(value) not in uploaded:
            uploaded[id(value)] = queue_upload(value, device)
        return uploaded[id(value)]

    cu = kwargs.get("cu_seq_lens_q")
    shift_labels = kwargs.get("shift_labels")
    host = HostRow(
        input_ids,
        position_ids if _on_host(position_ids) else None,
        cu if _on_host(cu) else None,
        labels if _on_host(labels) and shift_labels is None else None,
        shift_labels if _on_host(shift_labels) else None,
        # positions are left as given (None: the forward derives them, or computes M-RoPE's for media rows)
        positions_from_boundaries=position_ids is None and _on_host(cu),
        seq_idx=kwargs.get("seq_idx") if _on_host(kwargs.get("seq_idx")) else None,
    )
    kwargs = {key: up(value) if key in ROW_KWARGS else value for key, value in kwargs.items()}
    return up(input_ids), up(position_ids), up(attention_mask), up(labels), kwargs, host
