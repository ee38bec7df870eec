"""Mixture-of-experts feed-forward over routed tokens, in transformers' expert weight layout.

``gate_up_proj: [E, 2I, d]`` (gate rows first), ``down_proj: [E, d, I]``. ``eager`` loops over
the experts that were hit, as upstream's ``Qwen3_5MoeExperts``; ``grouped_mm`` sorts the
(token, slot) pairs by expert and runs two ``torch.nn.functional.grouped_mm`` calls; ``batched_mm``
gathers each pair's expert weights and runs two batched matmuls (more memory, fewer launches: what
transformers switches to for decoding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def eager(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn):
    """``sum_k w_k * down_e(act(gate_e x) * up_e x)`` over each token's chosen experts ``e``."""
    out = torch.zeros_like(hidden)
    for expert in torch.unique(top_k_index).tolist():
        token, slot = torch.where(top_k_index == expert)
        gate, up = F.linear(hidden[token], gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(act_fn(gate) * up, down_proj[expert]) * top_k_weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


def grouped_mm(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn):
    """As ``eager`` with one grouped GEMM per projection (float32 / bf16; bf16 needs 16-byte aligned rows)."""
    experts, top_k = gate_up_proj.shape[0], top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // top_k
    # Tokens per expert by index_add, not bincount: bincount sizes its output from the data, a host sync.
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device)
    ends = counts.index_add(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0).to(torch.int32)
    gate, up = F.grouped_mm(hidden[token], gate_up_proj.transpose(-2, -1), offs=ends).chunk(2, dim=-1)
    y = F.grouped_mm(act_fn(gate) * up, down_proj.transpose(-2, -1), offs=ends)
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(hidden).index_add(0, token, y.to(hidden.dtype))


def batched_mm(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn):
    """As ``eager``: one ``[d] x [2I, d]`` and one ``[I] x [d, I]`` product per (token, slot) pair, batched."""
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    x = hidden.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [N*k, d, 1]
    gate, up = torch.bmm(gate_up_proj[flat], x).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(down_proj[flat], (act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
    y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
    return y.view(hidden.shape[0], top_k, -1).sum(dim=1).to(hidden.dtype)
