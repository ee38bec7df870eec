"""Chunked gated delta rule in PyTorch: varlen, grouped value heads, initial and final state.

The math is upstream transformers' ``torch_chunk_gated_delta_rule`` (chunk size 64, UT transform
inside each chunk, a sequential scan over chunks), applied per sequence of a packed row so that
the chunk partition restarts at every sequence start, as the fused kernels' does.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from .varlen import compute_dtype, sequence_bounds

CHUNK = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, as upstream's (and fla's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
):
    """``o[t] = S_t^T (scale * q_t)`` with ``S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``.

    Returns ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] or None)``; the state is fp32
    (float64 for float64 inputs). ``chunk_indices`` is accepted for signature parity and unused.
    Reads ``cu_seqlens`` on the host (one sync unless ``cu_seqlens_cpu`` is given).
    """
    batch, length, heads, head_k = q.shape
    value_heads, head_v = v.shape[-2:]
    if value_heads % heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({heads})")
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"cu_seqlens needs one packed row (batch 1), got batch {batch}")
    dtype, out_dtype = compute_dtype(q.dtype), v.dtype
    scale = head_k**-0.5 if scale is None else scale

    # Rows of a batch are sequences of one long row: [HV, B*T, ...].
    group = value_heads // heads
    q, k = (x.repeat_interleave(group, dim=2) if group > 1 else x for x in (q, k))
    q, k, v = (x.to(dtype).reshape(batch * length, value_heads, -1).transpose(0, 1) for x in (q, k, v))
    g, beta = (x.to(dtype).reshape(batch * length, value_heads).transpose(0, 1) for x in (g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale

    if cu_seqlens is None:
        bounds = list(range(0, batch * length + 1, length)) if length else [0, 0]
    else:
        bounds = sequence_bounds(cu_seqlens, cu_seqlens_cpu, length)
    outputs, finals = [], []
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        if initial_state is None:
            state = q.new_zeros(value_heads, head_k, head_v)
        else:
            state = initial_state[index].to(dtype)
        piece = slice(start, end)
        out, state = _one_sequence(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], state)
        outputs.append(out)
        finals.append(state)
    o = torch.cat(outputs, dim=1).transpose(0, 1).reshape(batch, length, value_heads, head_v)
    final = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final


def _one_sequence(q, k, v, g, beta, state):
    """One sequence, ``[HV, L, .]`` tensors and state ``[HV, K, V]`` -> (output ``[HV, L, V]``, final state)."""
    length = q.shape[1]
    if length == 0:
        return v.new_zeros(v.shape), state
    pad = (-length) % CHUNK
    # Zero padding at the end changes nothing: zero keys write nothing, zero decay keeps the state.
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(1, (-1, CHUNK)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)).unflatten(1, (-1, CHUNK)) for x in (g, beta))

    cum = g.cumsum(-1)  # log decay from the chunk start to each position
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = prod of exp(g) over (j, i] for j <= i; masked before exp so it cannot overflow.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)

    # UT transform: (I + strictly_lower(diag(beta) K K^T * decay))^-1 turns the chunk's delta
    # updates into matmuls: u = new values, w = the decayed keys that read the carried state.
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    within = (q @ k.transpose(-1, -2)) * decay
    q_read = q * cum.exp().unsqueeze(-1)
    k_write = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()

    outputs = []
    for c in range(q.shape[1]):
        v_new = u[:, c] - w[:, c] @ state
        outputs.append(q_read[:, c] @ state + within[:, c] @ v_new)
        state = state * chunk_decay[:, c, None, None] + k_write[:, c].transpose(-1, -2) @ v_new
    return torch.cat(outputs, dim=1)[:, :length], state


# reads cu_seqlens as it is every call and keeps nothing derived from it: a padded plan may use it (shared_prefix/bucket.py)
gated_delta_rule.table_free = True
