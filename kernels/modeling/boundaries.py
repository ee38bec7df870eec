"""Sequence boundaries of a packed row: checked when given, derived from restarting positions when not.

A packed row reaches the model in one of two ways: with ``cu_seq_lens_q`` (flash-attention style
kwargs, ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or with ``position_ids``
alone that restart at 0 at every sequence start (the collator's default, TRL's ``padding_free``,
verl's remove-padding path). Both become one checked ``cu_seq_lens_q`` here, once per forward at
the top model, with one host copy; metadata that does not describe the row is refused, because a
wrong boundary gives wrong logits without any error.
"""

from __future__ import annotations

import torch

from .packing import PACKED_ROW, packed_row


class PackedMetadataError(ValueError):
    """Packed-row metadata (``cu_seq_lens_*``, ``position_ids``) that does not describe the row."""


def text_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The positions ``[B, T]`` whose zeros start sequences: the text positions of 2-D ids and of the 4-row (text +
    M-RoPE) layout; for M-RoPE's 3 rows, which have no text row, 0 only where all three rows are.

    M-RoPE's temporal row is no counter: an image or video opening a sequence holds it at 0 over all its tokens
    (upstream's ``get_rope_index``), while a sequence starts at (0, 0, 0) once.
    """
    if position_ids is None or position_ids.ndim == 2:
        return position_ids
    if position_ids.ndim == 3:
        return position_ids[0] if position_ids.shape[0] != 3 else position_ids.abs().amax(0)
    raise PackedMetadataError(
        f"position_ids must be [B, T], [3, B, T] or [4, B, T]; got shape {tuple(position_ids.shape)}"
    )


def resolve_packed(kwargs: dict, position_ids, tokens: torch.Tensor, cache=None, attention_mask=None, uploaded=None) -> dict:
    """``kwargs`` with checked boundaries of the packed row, derived from ``position_ids`` when absent.

    ``tokens`` is ``input_ids`` or ``inputs_embeds`` (its first two dims are ``[B, T]``). Returns the
    kwargs unchanged for an unpacked batch; else with ``cu_seq_lens_q/k`` and a ``PackedRow`` (whose
    host copy of the boundaries the mixers reuse). Raises ``PackedMetadataError`` for boundaries that
    do not fit the row, ``cu_seq_lens_k`` different from ``cu_seq_lens_q``, positions that do not
    restart at 0 at every sequence start and count up by one within it, a batch of several rows
    whose positions restart inside a row, ``max_length_q/k`` shorter than the longest sequence, and
    ``input_ids`` without a batch dimension. Under a padding ``attention_mask`` only restarts on real
    tokens count: pads sit at 0 in a padded batch (``clip(cumsum(mask) - 1, 0)``).

    ``uploaded``: the `host_rows.HostRow` of a row the top model uploaded; its boundaries, positions and seq_idx
    are checked on that host copy, with no copy back from the device.
    """
    if kwargs.get(PACKED_ROW) is not None:
        return kwargs  # checked by the top model already
    _refuse_missing_batch_dim(tokens, kwargs)
    batch, length = tokens.shape[:2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is not None:
        raise PackedMetadataError("cu_seq_lens_k was given without cu_seq_lens_q: pass the same boundaries as both")
    positions = text_positions(position_ids)
    seq_idx = kwargs.get("seq_idx")
    if cu_q is None:
        if cache is not None or (positions is None and seq_idx is None) or length < 2:
            return kwargs
        padded = has_padding(attention_mask)
        if padded and positions is not None:
            # A padded batch puts its pads at position 0 too (verl: clip(cumsum(mask) - 1, 0)): only a restart on
            # a real token marks a sequence (a packed row with padding is then refused by the text model).
            positions = positions.masked_fill(attention_mask.to(positions.device) == 0, 1)
        if batch != 1:
            if seq_idx is not None:
                _refuse_rows_packed_by_positions(_sequence_starts_as_positions(seq_idx), "seq_idx")
            if positions is not None and (position_ids.ndim == 2 or position_ids.shape[0] == 4):
                _refuse_rows_packed_by_positions(positions)
            return kwargs
        # DataCollatorWithFlattening(return_seq_idx=True) marks each token's sequence; its positions, when also
        # given, are then checked against those boundaries.
        cu_q = _index_changes(seq_idx, length) if seq_idx is not None else _restarts(positions, length)
        if cu_q is None:
            return kwargs
        kwargs = {**kwargs, "cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_q}
        host = cu_q.cpu()
        _check_max_lengths(kwargs, host)
        if not padded and positions is not None and (position_ids.ndim == 2 or position_ids.shape[0] == 4):
            source = "from seq_idx" if seq_idx is not None else "restarting at 0, no cu_seq_lens_q"
            _check_positions(positions, cu_q, f"position_ids ({source})")
    else:
        host_cu = None if uploaded is None else uploaded.cu_seq_lens_q
        host = check_cu_seqlens(cu_q if host_cu is None else host_cu, "cu_seq_lens_q", batch, length)
        if cu_k is not None and cu_k is not cu_q:
            check_cu_seqlens(cu_k, "cu_seq_lens_k", batch, length)
            if not torch.equal(cu_k.detach().cpu().long(), host.long()):
                raise PackedMetadataError(
                    f"cu_seq_lens_k {cu_k.tolist()} differs from cu_seq_lens_q {host.tolist()}: a packed row attends "
                    "within each of its own sequences, so both must be the same boundaries (pass cu_seq_lens_q as both)"
                )
        _check_max_lengths(kwargs, host)
        if seq_idx is not None:
            # checked on its host copy where it came on the host: a read of the uploaded one would sync
            host_seq_idx = None if uploaded is None else uploaded.seq_idx
            _check_seq_idx(seq_idx if host_seq_idx is None else host_seq_idx, host, length)
        if cache is not None:
            raise PackedMetadataError(
                "a packed row (cu_seq_lens_q) with a cache: the cached (generation) path runs one sequence per batch "
                "row; pass no cache to score or train a packed row, or unpack the sequences into batch rows to generate"
            )
        if uploaded is not None and uploaded.position_ids is not None:  # checked where they came from
            position_ids, positions, cu_q = uploaded.position_ids, text_positions(uploaded.position_ids), host
        if positions is not None and (position_ids.ndim == 2 or position_ids.shape[0] == 4):
            _check_positions(positions, cu_q, "position_ids")
    row = packed_row({**kwargs, PACKED_ROW: None}, batch, length, tokens.device, host=host)
    return {**kwargs, PACKED_ROW: row}


def _refuse_missing_batch_dim(tokens: torch.Tensor, kwargs: dict) -> None:
    """Raise for ``input_ids`` ``[T]`` (or ``inputs_embeds`` ``[T, d]``): a packed row is one batch row ``[1, T]``."""
    embeds = tokens.is_floating_point()
    if tokens.ndim >= (3 if embeds else 2):
        return
    name, fix = ("inputs_embeds", "inputs_embeds.unsqueeze(0)") if embeds else ("input_ids", "input_ids.unsqueeze(0)")
    packed = " with cu_seq_lens_q" if kwargs.get("cu_seq_lens_q") is not None else ""
    raise PackedMetadataError(
        f"{name} of shape {tuple(tokens.shape)}{packed} has no batch dimension: the model takes rows [batch, T], "
        f"and a packed row is one row [1, T] holding every sequence. Pass {fix} (and position_ids / labels as "
        "[1, T] likewise)"
    )


def _check_max_lengths(kwargs: dict, host_cu: torch.Tensor) -> None:
    """Raise for a caller's ``max_length_q`` / ``max_length_k`` shorter than the longest sequence of ``host_cu``.

    Flash-style varlen kernels size their launch by these (flash-attn 2 launches ``ceil(max_length_q / block)``
    query blocks per sequence), so a short one can leave the later tokens of a longer sequence uncomputed: wrong
    outputs, no error. A larger one only costs idle blocks. Read off the host copy of the boundaries: no sync.
    """
    longest = None  # read only when a length was given (most callers give none)
    for name in ("max_length_q", "max_length_k"):
        given = kwargs.get(name)
        if given is None or (isinstance(given, torch.Tensor) and given.device.type != "cpu"):
            continue  # none given, or reading it would wait for the device (the kernels read it as given)
        if longest is None:
            longest = int(host_cu.diff().max()) if host_cu.numel() > 1 else 0
        if int(given) < longest:
            raise PackedMetadataError(
                f"{name}={int(given)} is shorter than the longest sequence of the packed row ({longest} tokens; "
                f"boundaries {host_cu.tolist()}): the varlen attention kernels would leave that sequence's tokens "
                f"past {int(given)} uncomputed and give wrong outputs without an error. Pass {name}={longest} "
                "(the largest of cu_seq_lens_q.diff()), or leave it out and it is read from the boundaries"
            )


def has_padding(attention_mask) -> bool:
    """Whether a 2-D ``attention_mask`` tensor masks any token out (one host sync; False for None or a mask mapping)."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2 and not bool(attention_mask.all())


def _refuse_rows_packed_by_positions(positions: torch.Tensor, what: str = "position_ids") -> None:
    """Raise for ``[B > 1, T]`` positions that start a row at 0 and restart at 0 inside it (several sequences a row).

    The recurrent mixers run each batch row as one sequence, so sequences sharing a row would leak into each
    other through the conv and the delta rule (transformers' attention mask would keep them apart: half right).
    """
    inner = (positions[:, 1:] == 0) & (positions[:, :1] == 0)
    rows = inner.any(1)
    if bool(rows.any()):
        row = int(rows.nonzero()[0])
        raise PackedMetadataError(
            f"{what} of a batch of {positions.shape[0]} rows start a new sequence inside row {row} (at token "
            f"{int(inner[row].nonzero()[0]) + 1}): each such row holds several sequences, which are kept apart only on "
            "one row [1, T]. Pack the sequences into one row [1, T] (DataCollatorWithFlattening, or with "
            "cu_seq_lens_q), or pass one sequence per row (padded, with an attention_mask)"
        )


def check_cu_seqlens(cu, name: str, batch: int, length: int) -> torch.Tensor:
    """Check that ``cu`` is ``[N + 1]`` integer boundaries from 0 to ``length``, non-decreasing; its host copy."""
    if not torch.is_tensor(cu):
        raise PackedMetadataError(f"{name} must be a tensor of int32 boundaries [N + 1], got {type(cu).__name__}")
    if cu.ndim != 1:
        raise PackedMetadataError(
            f"{name} must be 1-D [N + 1] (the boundaries of one packed row), got shape {tuple(cu.shape)}; "
            "pack a batch into one row [1, T] and pass its boundaries"
        )
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise PackedMetadataError(f"{name} must hold integers (int32), got {cu.dtype}")
    if cu.numel() < 2:
        raise PackedMetadataError(f"{name} must hold at least [0, T], got {cu.tolist()}")
    if batch != 1:
        raise PackedMetadataError(
            f"{name} describes one packed row (batch 1), got input of batch {batch}: pack the rows into [1, T]"
        )
    host = cu.detach().cpu()
    if int(host[0]) != 0 or int(host[-1]) != length or bool((host[1:] < host[:-1]).any()):
        raise PackedMetadataError(
            f"{name} {host.tolist()} does not describe a packed row of {length} tokens: boundaries must start at 0, "
            f"never decrease and end at {length}"
        )
    return host


def _restarts(positions: torch.Tensor, length: int) -> torch.Tensor | None:
    """``cu_seqlens`` (int32) where the positions of one row restart at 0, or None for a single sequence."""
    row = positions[0]
    starts = (row == 0).nonzero().flatten()
    if starts.numel() < 2 or int(starts[0]) != 0:
        return None  # one sequence (or positions offset by a cache-less continuation): nothing to split
    end = torch.tensor([length], device=starts.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


def _index_changes(seq_idx: torch.Tensor, length: int) -> torch.Tensor | None:
    """``cu_seqlens`` (int32) where a ``[1, T]`` row of sequence indices changes, or None for a single sequence."""
    row = seq_idx.reshape(-1)
    if row.numel() != length:
        raise PackedMetadataError(f"seq_idx must be [1, T] with T = {length}, got shape {tuple(seq_idx.shape)}")
    changes = (row[1:] != row[:-1]).nonzero().flatten() + 1
    if changes.numel() == 0:
        return None
    ends = torch.tensor([0, length], device=changes.device, dtype=changes.dtype)
    return torch.cat([ends[:1], changes, ends[1:]]).to(torch.int32)


def _check_seq_idx(seq_idx: torch.Tensor, cu: torch.Tensor, length: int) -> None:
    """``seq_idx`` given beside ``cu_seq_lens_q`` must mark the same sequences (cu's empty ones aside): the
    row follows the boundaries, so a disagreeing one would be ignored without a word."""
    marked = _index_changes(seq_idx.detach().cpu(), length)
    marked = torch.tensor([0, length]) if marked is None else marked
    if not torch.equal(marked.long(), torch.unique_consecutive(cu.long())):
        raise PackedMetadataError(
            f"seq_idx marks the sequences {marked.tolist()}, which disagrees with cu_seq_lens_q {cu.tolist()}: both "
            "describe the same packed row; pass the boundaries of one (or make the collator's two agree)"
        )


def _sequence_starts_as_positions(seq_idx: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` sequence indices as positions that are 0 at every sequence start (for the batch refusal)."""
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return (~starts).long()


def _check_positions(positions: torch.Tensor, cu: torch.Tensor, what: str) -> None:
    from ..shared_prefix import positions_from_cu_seqlens

    expected = positions_from_cu_seqlens(cu.to(positions.device), positions.shape[-1])
    if not torch.equal(positions.to(expected.dtype), expected):
        bad = int((positions.to(expected.dtype) != expected).flatten().nonzero()[0])
        raise PackedMetadataError(
            f"{what} disagree with the packed row's boundaries {cu.tolist()}: token {bad} has position "
            f"{int(positions.flatten()[bad])}, expected {int(expected.flatten()[bad])}. Every sequence of a packed "
            "row starts at position 0 and counts up by one; pass position_ids that restart at each boundary, or none"
        )
