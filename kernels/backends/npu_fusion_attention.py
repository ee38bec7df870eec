"""``torch_npu.npu_fusion_attention`` (Ascend) behind the attention slot.

Varlen rows go in as layout ``"TND"`` with the per-segment ends as Python lists (``actual_seq_qlen``
/ ``actual_seq_kvlen``: cumulative, without the leading 0). Causal is ``sparse_mode=3``
(rightDownCausal: each segment's mask aligned bottom-right, the flash convention) with the 2048x2048
compressed upper-triangular mask the operator documents for modes 2-4. Differentiable in torch_npu.
"""

from __future__ import annotations

import torch
import torch_npu

from .npu_dtypes import require_npu_float

RIGHT_DOWN_CAUSAL = 3  # sparse_mode: rightDownCausal
NO_MASK = 0  # sparse_mode: defaultMask, with atten_mask=None: full attention
COMPRESSED_MASK = 2048  # the side of the compressed mask that sparse modes 2, 3 and 4 take
MAX_SEGMENTS = 1024  # varlen: actual_seq_qlen holds at most 1K entries
TOKENS_UNBOUNDED = 2147483647  # pre_tockens / next_tockens default: no band

_masks: dict[torch.device, torch.Tensor] = {}
# The last cu_seqlens tensors read to the host (id -> (tensor, version, values)): every layer of a
# micro-batch passes the same ones (q and k differ on shared-prefix rows), so each is read once.
_host: dict[int, tuple[torch.Tensor, int, list[int]]] = {}
_HOST_ENTRIES = 4


def causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed causal mask (True = masked), built once per device."""
    mask = _masks.get(device)
    if mask is None:
        # kept for every later call: made in an inference-mode forward it would be an inference tensor, which the
        # operator's backward (it saves atten_mask) of a later training forward cannot save
        with torch.inference_mode(False):
            mask = torch.ones(COMPRESSED_MASK, COMPRESSED_MASK, dtype=torch.bool, device=device).triu(1)
        _masks[device] = mask
    return mask


def host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as Python ints, read to the host once per tensor (and again only if it was modified).

    An inference tensor (boundaries made in an inference-mode forward) has no version counter to tell a refill in
    place: it is read every time."""
    if cu_seqlens.is_inference():
        return [int(b) for b in cu_seqlens.tolist()]
    entry = _host.get(id(cu_seqlens))
    if entry is not None and entry[0] is cu_seqlens and entry[1] == cu_seqlens._version:
        return entry[2]
    values = [int(b) for b in cu_seqlens.tolist()]
    if len(_host) >= _HOST_ENTRIES:
        _host.pop(next(iter(_host)))
    _host[id(cu_seqlens)] = (cu_seqlens, cu_seqlens._version, values)
    return values


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal=True):
    """Varlen attention through ``npu_fusion_attention``; GQA by head counts, causal aligned bottom-right."""
    require_npu_float("npu_fusion_attention", "attention", q, k, v)
    bounds_q, bounds_k = host_bounds(cu_seqlens_q), host_bounds(cu_seqlens_k)
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seqlens_q has {len(bounds_q) - 1} segments, cu_seqlens_k {len(bounds_k) - 1}")
    segments = len(bounds_q) - 1
    if segments == 0 or q.shape[0] == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    pieces = []
    # The operator takes at most MAX_SEGMENTS segments per call: longer rows go in slices of segments.
    for first in range(0, segments, MAX_SEGMENTS):
        last = min(first + MAX_SEGMENTS, segments)
        qs, qe, ks, ke = bounds_q[first], bounds_q[last], bounds_k[first], bounds_k[last]
        pieces.append(
            _call(
                q[qs:qe],
                k[ks:ke],
                v[ks:ke],
                [b - qs for b in bounds_q[first + 1 : last + 1]],
                [b - ks for b in bounds_k[first + 1 : last + 1]],
                scale,
                causal,
            )
        )
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _call(q, k, v, ends_q, ends_k, scale, causal):
    out = torch_npu.npu_fusion_attention(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        q.shape[1],
        "TND",
        atten_mask=causal_mask(q.device) if causal else None,
        scale=float(scale),
        keep_prob=1.0,
        pre_tockens=TOKENS_UNBOUNDED,
        next_tockens=0 if causal else TOKENS_UNBOUNDED,
        actual_seq_qlen=ends_q,
        actual_seq_kvlen=ends_k,
        sparse_mode=RIGHT_DOWN_CAUSAL if causal else NO_MASK,
    )
    return out[0]
