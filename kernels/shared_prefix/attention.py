"""Full attention on the compact row: queries stay compact, keys and values are gathered.

One varlen call whatever the depth of the prefix tree: each segment's queries (a node, a leaf, a
singleton) against the keys of all its ancestors followed by its own, `(q=len, k=offset+len)`;
causal aligned bottom-right, so every query sees its whole ancestry and its own earlier rows:
exactly the packed mask. K and V are gathered after RoPE and q/k-norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout import Layout
from .rows import Arena, ranges_into


@dataclass(frozen=True, eq=False)
class AttentionIndex:
    kv_src: torch.Tensor  # [Tk] compact row of each gathered key/value row
    cu_seqlens_q: torch.Tensor  # [n + 1] int32, over the compact row
    cu_seqlens_k: torch.Tensor  # [n + 1] int32, over the gathered keys
    max_seqlen_q: int
    max_seqlen_k: int


def attention_host_index(layout: Layout, arena: Arena | None = None) -> dict:
    """Host arrays of the one attention call, written into `arena` when given; uploaded by the plan builder."""
    arena = arena or Arena()
    segs = (layout.length > 0).nonzero()[0]
    q_lengths = layout.length[segs]
    k_lengths = layout.offset[segs] + q_lengths
    return {
        "max_q": int(q_lengths.max()),
        "max_k": int(k_lengths.max()),
        "kv_src": attention_keys(layout, segs, arena),
        "cu_q": arena.boundaries(q_lengths),
        "cu_k": arena.boundaries(k_lengths),
    }


def attention_keys(layout: Layout, segs, arena: Arena | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """The compact rows of every key the segments `segs` read: per segment its ancestors' rows, root first, then
    its own; written into `out` when given (as many rows as the keys), else into `arena`."""
    path = layout.ancestry[segs]  # root .. each segment: every key its queries see, in order
    path = path[path >= 0]
    if out is not None:
        return ranges_into(out, layout.start[path], layout.length[path])
    return arena.ranges(layout.start[path], layout.length[path])


def attention_index(host: dict, dev: dict) -> AttentionIndex:
    return AttentionIndex(dev["kv_src"], dev["cu_q"], dev["cu_k"], int(host["max_q"]), int(host["max_k"]))


def attention_kv(plan, k: torch.Tensor, v: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values gathered for the shared-prefix segments (after RoPE and k-norm)."""
    src = plan.attention.kv_src
    return k.index_select(dim, src), v.index_select(dim, src)


def shared_prefix_attention(plan, attn_fn, q, k, v, *, scale: float) -> torch.Tensor:
    """Causal attention over the compact row in one `attn_fn` call (the `attention` slot).

    `q: [1, C, H, D]`, `k, v: [1, C, Hkv, D]` (compact rows, after RoPE); returns `[1, C, H, D]`.
    """
    idx: AttentionIndex = plan.attention
    # squeeze, not [0]: a view whose backward is a view (select's backward writes a zero-filled copy)
    q, k, v = (x.squeeze(0) for x in (q, k, v))
    k_all, v_all = attention_kv(plan, k, v)
    o = attn_fn(
        q,
        k_all,
        v_all,
        cu_seqlens_q=idx.cu_seqlens_q,
        cu_seqlens_k=idx.cu_seqlens_k,
        max_seqlen_q=idx.max_seqlen_q,
        max_seqlen_k=idx.max_seqlen_k,
        scale=scale,
        causal=True,
    )
    return o.unsqueeze(0)
