"""The LM head of the generated causal-LM forwards: logits, the loss, per-token log-probs and entropy.

The loss and the per-token values go through the ``cross_entropy`` slot on hidden rows (fused
linear cross-entropy on GPU), on both paths, so flag on and flag off compute the same thing. On
the shared-prefix path each distinct (compact row, label) pair is scored once and the per-token
values are expanded back to ``[1, T]``; the scalar loss is recomputed from them with the packed
normalisation (mean over valid labels, or ``num_items_in_batch``), so it is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.modeling_utils import slice_logits_to_keep

from ..capabilities import ENTROPY, SYNC_FREE
from ..reference.cross_entropy import through_module
from ..shared_prefix.lm_rows import first_disagreement
from .host_rows import queue_upload
from .packing import next_token_labels
from .plain_modules import plain_linears
from .user_warning import warn_at_caller

IGNORE_INDEX = -100


@dataclass(frozen=True)
class HeadRequest:
    """What the caller asked of the head, popped from the forward's kwargs before they go down."""

    log_probs: bool = False  # ``return_log_probs=True``: ``output.log_probs [1, T]``, 0 where ignored
    entropy: bool = False  # ``return_entropy=True``: ``output.entropy [1, T]``
    logits: bool = True  # ``return_logits=False`` skips the ``[1, T, vocab]`` logits
    temperature: float = 1.0  # ``temperature=t``: loss, log-probs and entropy of ``logits / t`` (logits unscaled)
    # ``labelled_positions_only=True``: log-probs and entropy wanted where a label is scored only
    # (0 elsewhere), so rows without a label skip the head even when entropy is asked for
    labelled_only: bool = False
    # the host copy of a row the top model uploaded (`host_rows.HostRow`): the head counts its scored rows there
    host: object = field(default=None, compare=False)

    @classmethod
    def pop(cls, kwargs: dict, uploaded=None) -> HeadRequest:
        temperature = kwargs.pop("temperature", None)
        temperature = 1.0 if temperature is None else float(temperature)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (log-probs of logits / temperature), got {temperature}")
        return cls(
            log_probs=bool(kwargs.pop("return_log_probs", False)),
            entropy=bool(kwargs.pop("return_entropy", False)),
            logits=bool(kwargs.pop("return_logits", True)),
            temperature=temperature,
            labelled_only=bool(kwargs.pop("labelled_positions_only", False)),
            host=uploaded,
        )

    @property
    def skips_unlabelled_rows(self) -> bool:
        """Rows whose label is ignored are owed nothing: no log-prob, no loss, and entropy only on request."""
        return not self.entropy or self.labelled_only


@dataclass
class HeadOutputs:
    logits: torch.Tensor | None
    loss: torch.Tensor | None
    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None

    def attach(self, output):
        """Put ``log_probs`` / ``entropy`` on a model output (as keys and attributes) when computed."""
        for name in ("log_probs", "entropy"):
            value = getattr(self, name)
            if value is not None:
                output[name] = value
        return output


def _keeps_all(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def _slice_positions(values: torch.Tensor, logits_to_keep) -> torch.Tensor:
    return slice_logits_to_keep(values.unsqueeze(-1), logits_to_keep).squeeze(-1)


def _kept(length: int, logits_to_keep) -> int:
    """How many positions ``slice_logits_to_keep`` keeps of a row of ``length``."""
    if isinstance(logits_to_keep, int):
        return length if logits_to_keep == 0 else min(logits_to_keep, length)
    return int(torch.zeros(length, 1)[logits_to_keep].shape[0])


def _checked(name: str, values, batch: int, length: int, kept: int) -> str:
    """``"full"`` for ``[B, T]`` labels, ``"kept"`` for labels of the kept positions only; else a clear error."""
    if not torch.is_tensor(values):
        raise ValueError(f"{name} must be a tensor of token ids [batch, seq_len], got {type(values).__name__}")
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids (-100 to ignore), got {values.dtype}")
    shape = tuple(values.shape)
    if shape == (batch, length):
        return "full"
    if kept != length and shape == (batch, kept):
        return "kept"
    kept_note = f" or, with logits_to_keep, the kept positions {(batch, kept)}" if kept != length else ""
    raise ValueError(
        f"{name} has shape {shape} but the input is {(batch, length)}: {name} must match the input tokens "
        f"{(batch, length)}{kept_note}" + ("; labels are the input ids (the model shifts them), not the targets"
                                            if name == "labels" else "")
    )


def _targets(labels, shift_labels, input_ids, cu_seqlens, logits_to_keep, want_values: bool, batch: int, length: int):
    """Next-token labels of the kept positions: ``shift_labels``, else shifted ``labels``, else from ``input_ids``.

    Labels of the whole row are shifted, then cut to the kept positions; labels of the kept positions
    only are shifted within them, as upstream does when ``logits_to_keep`` and ``labels`` meet.
    """
    kept = _kept(length, logits_to_keep)
    if shift_labels is not None:
        form = _checked("shift_labels", shift_labels, batch, length, kept)
        return _slice_positions(shift_labels, logits_to_keep) if form == "full" and kept != length else shift_labels
    if labels is not None:
        form = _checked("labels", labels, batch, length, kept)
        # On a packed row the last token of each sequence has no next token: its shifted label would
        # be the next sequence's first token, so it is ignored (as at the row's end).
        boundaries = cu_seqlens if form == "full" else None
        shifted = next_token_labels(labels, boundaries, IGNORE_INDEX)
        return _slice_positions(shifted, logits_to_keep) if form == "full" and kept != length else shifted
    if want_values and input_ids is not None:
        return _slice_positions(next_token_labels(input_ids, cu_seqlens, IGNORE_INDEX), logits_to_keep)
    return None


def reduce_loss(nll: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """transformers' causal-LM reduction: mean over valid labels, or sum over ``num_items_in_batch``."""
    valid = targets != IGNORE_INDEX
    total = torch.where(valid, nll, torch.zeros_like(nll)).sum()
    if num_items_in_batch is None:
        return total / valid.sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_head(
    lm_head: torch.nn.Linear,
    table,
    hidden_states: torch.Tensor,
    *,
    plan=None,
    labels=None,
    input_ids=None,
    logits_to_keep=0,
    request: HeadRequest = HeadRequest(),
    kwargs: dict | None = None,
) -> HeadOutputs:
    """Logits, loss, log-probs and entropy from the last hidden states (compact ``[1, C, d]`` under ``plan``)."""
    kwargs = kwargs or {}
    want_values = request.log_probs or request.entropy
    if plan is not None and not _keeps_all(logits_to_keep):
        # logits_to_keep picks packed positions: no dedup, score the expanded rows.
        hidden_states, plan = plan.expand(hidden_states, dim=1), None
    cu = kwargs.get("cu_seq_lens_q")
    batch, length = hidden_states.shape[0], plan.packed_length if plan is not None else hidden_states.shape[1]
    targets = _targets(labels, kwargs.get("shift_labels"), input_ids, cu, logits_to_keep, want_values, batch, length)
    # Scoring logits / t is scoring the hidden rows / t: the head is a bias-free linear map.
    scale = None if request.temperature == 1.0 else 1.0 / request.temperature
    labelled = labels is not None or kwargs.get("shift_labels") is not None
    scored = targets is not None and (labelled or want_values)
    # targets read off input_ids ignore only each sequence's last position: counting the rest to skip those few
    # rows would cost a host sync after the layers, with the device idle while the head is launched
    skip = request.skips_unlabelled_rows and (labelled or request.entropy)
    # the targets of the host copy of a host row, built once: the label check and the count of owed rows read them
    host_targets = _host_targets(request.host, batch, length) if _keeps_all(logits_to_keep) else None
    cross_entropy = head_backend(table, request)
    weight = lm_head.weight
    if not plain_linears(lm_head):
        # a wrapped head (LoRA on lm_head, quantised): scored through its own forward, never its bare weight
        cross_entropy, weight = through_module(lm_head), None

    def every_position(hidden):  # (nll, entropy) of every position of `hidden [batch, length, d]`, each its own row
        flat = hidden.reshape(-1, hidden.shape[-1])
        keep = _kept_on_host(host_targets, None, hidden.device) if skip else None
        nll, entropy = _score_rows(
            cross_entropy, _rows_of(flat, None), weight, targets.reshape(-1).to(hidden.device), scale, request, skip,
            keep=keep,
        )
        # an ignored position scores nothing whatever the backend returns for it (rows are no longer always
        # skipped: see `skip`)
        nll = nll.view(targets.shape).masked_fill(targets.to(nll.device) == IGNORE_INDEX, 0.0)
        return nll, entropy.view(targets.shape) if entropy is not None else None

    if plan is None:
        hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
        logits = lm_head(hidden_states) if request.logits else None
        if not scored:
            return HeadOutputs(logits, None, None, None)
        nll, entropy = every_position(hidden_states)
    else:
        logits = plan.expand(lm_head(hidden_states), dim=1) if request.logits else None
        if not scored:
            return HeadOutputs(logits, None, None, None)
        rows = plan.lm_rows(targets.to(hidden_states.device))
        disagreement = _labels_disagree(host_targets, plan, rows) if labelled else None
        if disagreement is not None:
            # a shared row would be scored against one member's label only: every position gets its own row
            _warn_labels_disagree(disagreement)
            nll, entropy = every_position(plan.expand(hidden_states, dim=1))
        else:
            nll, entropy = _shared_rows(
                rows, hidden_states, targets, cross_entropy, weight, scale, request, skip,
                _kept_on_host(host_targets, plan, hidden_states.device) if skip else None,
            )

    loss = None
    if labels is not None or kwargs.get("shift_labels") is not None:
        loss = reduce_loss(nll, targets.to(nll.device), kwargs.get("num_items_in_batch"))
    log_probs = -nll if request.log_probs else None
    return HeadOutputs(logits, loss, log_probs, entropy if request.entropy else None)


def head_backend(table, request: HeadRequest):
    """The `cross_entropy` backend of one head call.

    Entropy is asked per call (RL trainers want it on some passes only): a backend without it (liger's fused
    head) hands those calls to the first backend of the device's order that has it. A scoring pass (no
    gradients) goes to a backend that reads nothing back to the host, when the slot was chosen automatically:
    liger counts its valid targets on the host, and that sync waits for the whole forward, so a loop of scoring
    calls could not queue its next call while the device runs this one. An explicitly chosen backend stands.
    """
    chosen = table.serving("cross_entropy", ENTROPY) if request.entropy else table.cross_entropy
    if torch.is_grad_enabled():
        return chosen
    bound = table.choices["cross_entropy"]
    if bound.explicit or SYNC_FREE in bound.handle.capabilities:
        return chosen
    sync_free = table.serving_choice("cross_entropy", SYNC_FREE)
    if request.entropy and ENTROPY not in sync_free.handle.capabilities:
        return chosen
    return table.serving("cross_entropy", SYNC_FREE)


def _rows_of(flat: torch.Tensor, entries: torch.Tensor | None):
    """``rows(keep)``: the hidden rows of the scored entries ``[N, d]`` (every entry for ``keep=None``).

    ``entries`` maps each entry to its row of ``flat`` (the shared-prefix LM rows), None when entry i is
    row i. The kept entries' rows are gathered from ``flat`` in one gather (their indices composed on the
    index, not the rows gathered twice): one ``[N, d]`` copy instead of two on the shared-prefix path.
    """

    def rows(keep: torch.Tensor | None) -> torch.Tensor:
        if entries is None:
            return flat if keep is None else flat.index_select(0, keep)
        return flat.index_select(0, entries if keep is None else entries.index_select(0, keep))

    return rows


class SharedPrefixLabels(UserWarning):
    """Members of a shared prefix give one of its rows different valid labels: the call is scored packed."""


def _warn_labels_disagree(position: int) -> None:
    at = f" (first at packed position {position})" if position >= 0 else ""
    warn_at_caller(
        f"shared_prefix_training: the labels inside a shared prefix differ between the sequences that share it{at} "
        "(a shared row is scored once, so sharing needs the same next token from every member there, or -100); this "
        "call's loss, log-probs and entropy are scored packed, position by position, at the packed head's cost. "
        "Labels that are the shifted input ids (with -100 where not scored) never differ there.",
        SharedPrefixLabels,
    )


def _shared_rows(rows, hidden_states, targets, cross_entropy, weight, scale, request: HeadRequest, skip: bool, keep):
    """(nll, entropy) at packed positions from the plan's LM rows, each distinct (row, label) scored once."""
    # reshape, not [0]: a view whose backward is a view (select's backward writes a zero-filled copy)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    nll_rows, entropy_rows = _score_rows(
        cross_entropy, _rows_of(flat, rows.rows), weight, rows.labels, scale, request, skip, keep=keep
    )
    # A position whose own label is ignored scores nothing, even if its shared entry was scored
    # for another member of the group.
    nll = rows.expand(nll_rows).masked_fill(targets.to(nll_rows.device) == IGNORE_INDEX, 0.0)
    entropy = rows.expand(entropy_rows) if entropy_rows is not None else None
    if entropy is not None and request.labelled_only:
        entropy = entropy.masked_fill(targets.to(entropy.device) == IGNORE_INDEX, 0.0)
    return nll, entropy


def _labels_disagree(host_targets, plan, rows) -> int | None:
    """None when the members of every shared row give it the same valid label; else the first packed position that
    differs, found on the host copy of a host row (`host_targets`: no sync), or -1 when the device answered (one
    sync, before the head: it waits for the layers, as a labelled call counting its rows on the device does right
    after)."""
    if host_targets is None:
        return -1 if bool(rows.disagree(IGNORE_INDEX)) else None
    return first_disagreement(plan.lm.host_inverse, plan.lm.length, host_targets.reshape(-1).numpy(), IGNORE_INDEX)


def _host_targets(host, batch: int, length: int) -> torch.Tensor | None:
    """The targets of the host copy of an uploaded row (None when there is none: no host row; labels whose
    boundaries came on the device)."""
    if host is None or (host.shift_labels is None and (host.labels is None or host.cu_seq_lens_q is None)):
        return None
    return _targets(host.labels, host.shift_labels, None, host.cu_seq_lens_q, 0, False, batch, length)


def _kept_on_host(host_targets, plan, device) -> torch.Tensor | None:
    """The scored entries (a label is owed) counted on the host copy of an uploaded row's targets, on `device`:
    what `_score_rows` would count with `nonzero` on the device, a sync after the layers. None when there is no
    host copy of the targets (no host row; labels whose boundaries came on the device; a `logits_to_keep` slice)."""
    if host_targets is None:
        return None
    owed = (host_targets.reshape(-1) != IGNORE_INDEX).numpy()
    if plan is not None:  # an entry is owed when any member's position it serves is (the device's amax)
        entries = np.zeros(plan.lm.length, dtype=bool)
        entries[plan.lm.host_inverse[owed]] = True
        owed = entries
    return queue_upload(torch.from_numpy(np.flatnonzero(owed)), device)


def _score_rows(cross_entropy, rows, weight, labels, scale, request: HeadRequest, skip: bool, keep=None):
    """``(nll [N], entropy [N] or None)`` of the hidden rows ``rows(keep)`` (see ``_rows_of``) against
    ``labels``, through the slot.

    The head's cost is per row (a ``[rows, vocab]`` product), and RL and SFT rows are mostly prompt,
    whose labels are ignored: when nothing is owed to those rows they are left out, at the price of
    one sync to count the rest (``skip``), or none when ``keep`` (those entries, counted on the host) is given.
    Their nll is 0 either way; their entropy, when asked for with ``labelled_only``, is 0 by that request's
    contract.
    """
    scored = (lambda r, y: cross_entropy(
        r if scale is None else r * scale, weight, y, ignore_index=IGNORE_INDEX, return_entropy=request.entropy
    ))
    if skip:
        keep = (labels != IGNORE_INDEX).nonzero().squeeze(1) if keep is None else keep
        if 0 < keep.numel() < labels.numel():
            nll, entropy = scored(rows(keep), labels.index_select(0, keep))
            nll = nll.new_zeros(labels.shape).index_copy(0, keep, nll)
            if entropy is not None:
                entropy = entropy.new_zeros(labels.shape).index_copy(0, keep, entropy)
            return nll, entropy
    return scored(rows(None), labels)
