"""Varlen attention over packed rows, per segment: ``eager`` (explicit softmax) and ``sdpa``.

Causal masks align bottom-right: query ``i`` of a segment with ``Lq`` queries and ``Lk >= Lq``
keys sees keys ``0 .. i + Lk - Lq``, as the flash kernels do for ``q_len < k_len``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import compute_dtype, sequence_bounds


def _segments(q, k, cu_seqlens_q, cu_seqlens_k):
    q_bounds = sequence_bounds(cu_seqlens_q, None, q.shape[0])
    k_bounds = sequence_bounds(cu_seqlens_k, None, k.shape[0])
    if len(q_bounds) != len(k_bounds):
        raise ValueError(f"cu_seqlens_q has {len(q_bounds) - 1} segments, cu_seqlens_k {len(k_bounds) - 1}")
    return list(zip(q_bounds, q_bounds[1:], k_bounds, k_bounds[1:]))


def _allowed(q_len, k_len, device):
    """Bottom-right causal mask ``[q_len, k_len]``: True where a query may read a key."""
    rows = torch.arange(q_len, device=device).unsqueeze(-1)
    cols = torch.arange(k_len, device=device)
    return cols <= rows + (k_len - q_len)


def _equal_rows(segments) -> bool:
    """Whether every segment has the same positive length, its keys being its queries (per-row metadata)."""
    if len(segments) < 1:
        return False
    length = segments[0][1] - segments[0][0]
    return length > 0 and all(qe - qs == length and (ks, ke) == (qs, qe) for qs, qe, ks, ke in segments)


def eager(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal=True):
    """Softmax attention written out (scores and softmax in fp32), one segment at a time."""
    group = q.shape[1] // k.shape[1]
    dtype = compute_dtype(q.dtype)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    pieces = []
    for qs, qe, ks, ke in _segments(q, k, cu_seqlens_q, cu_seqlens_k):
        qi = q[qs:qe].transpose(0, 1).to(dtype)
        ki = k[ks:ke].repeat_interleave(group, dim=1).transpose(0, 1).to(dtype)
        vi = v[ks:ke].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qi @ ki.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(~_allowed(qe - qs, ke - ks, q.device), float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        pieces.append((probs @ vi).transpose(0, 1))
    return torch.cat(pieces, dim=0) if pieces else out


def sdpa(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal=True):
    """``F.scaled_dot_product_attention`` per segment, with a bottom-right boolean mask when causal."""
    gqa = q.shape[1] != k.shape[1]
    segments = _segments(q, k, cu_seqlens_q, cu_seqlens_k)
    if causal and _equal_rows(segments):
        # Rows of one length, keys = queries (a batch of unpacked rows): one batched call, whose top-left
        # causal mask is the bottom-right one when q_len == k_len.
        rows, length = len(segments), segments[0][1] - segments[0][0]
        qb, kb, vb = (x.view(rows, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[-1])
    pieces = []
    for qs, qe, ks, ke in segments:
        qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q[qs:qe], k[ks:ke], v[ks:ke]))
        mask = _allowed(qe - qs, ke - ks, q.device) if causal else None
        out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)
        pieces.append(out.squeeze(0).transpose(0, 1))
    if not pieces:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(pieces, dim=0)
