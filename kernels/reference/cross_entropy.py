"""Per-token negative log-likelihood (and entropy) from hidden states and the LM head.

``chunked`` computes the logits of a bounded number of rows at a time and recomputes them in the
backward (activation checkpointing), so the full ``[N, vocab]`` fp32 logits never exist at once;
``eager`` materialises them (the simple reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .varlen import compute_dtype

# Rows per chunk are chosen so that one chunk's fp32 logits stay under this many elements.
CHUNK_ELEMENTS = 1 << 25


def _rows(hidden, weight, labels, ignore_index: int, return_entropy: bool):
    return _from_logits(hidden @ weight.T, labels, ignore_index, return_entropy)


def _from_logits(logits, labels, ignore_index: int, return_entropy: bool):
    logits = logits.to(compute_dtype(logits.dtype))
    log_probs = F.log_softmax(logits, dim=-1)
    keep = labels != ignore_index
    picked = log_probs.gather(-1, torch.where(keep, labels, 0).unsqueeze(-1)).squeeze(-1)
    nll = torch.where(keep, -picked, 0.0)
    if not return_entropy:
        return nll
    return nll, -(log_probs.exp() * log_probs).sum(-1)


def eager(hidden, weight, labels, *, ignore_index=-100, return_entropy=False):
    """``(nll [N] fp32, 0 where ignored; entropy [N] fp32 or None)`` with the full logits in memory."""
    out = _rows(hidden, weight, labels, ignore_index, return_entropy)
    return out if return_entropy else (out, None)


def chunked(hidden, weight, labels, *, ignore_index=-100, return_entropy=False):
    """As ``eager``, holding at most ``CHUNK_ELEMENTS`` fp32 logits at a time, in forward and backward."""
    rows = max(1, CHUNK_ELEMENTS // max(1, weight.shape[0]))
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    nll, entropy = [], []
    for start in range(0, hidden.shape[0], rows):
        piece = (
            hidden[start : start + rows],
            weight,
            labels[start : start + rows],
            ignore_index,
            return_entropy,
        )
        out = checkpoint(_rows, *piece, use_reentrant=False) if grad else _rows(*piece)
        nll.append(out[0] if return_entropy else out)
        if return_entropy:
            entropy.append(out[1])
    if not nll:
        empty = hidden.new_zeros(0, dtype=compute_dtype(hidden.dtype))
        return empty, (empty if return_entropy else None)
    return torch.cat(nll), (torch.cat(entropy) if return_entropy else None)


def through_module(head: torch.nn.Module):
    """The slot's signature with the logits from calling `head` (its `.weight` is not read): for an LM head a
    fused op cannot read, a LoRA-wrapped or quantised one. The full logits are materialised, as in `eager`."""

    def scored(hidden, weight, labels, *, ignore_index=-100, return_entropy=False):
        out = _from_logits(head(hidden), labels, ignore_index, return_entropy)
        return out if return_entropy else (out, None)

    return scored
