"""Float64 references for the shared-prefix tests, with the op-slot signatures of docs/ops.md.

Written here, independent of the kernel layer: a token-by-token recurrent GDN, a chunked GDN
(chunk 64, every sequence padded to whole chunks so every chunk has one shape), a varlen
depthwise causal conv and a varlen bottom-right causal attention. Everything is autograd-able,
so gradients of every input, the initial state included, come from torch.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

CHUNK = 64


def _segments(cu_seqlens, length):
    if cu_seqlens is None:
        return [(0, length)]
    cu = cu_seqlens.tolist()
    return list(itertools.pairwise(cu))


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepare(q, k, v, scale, use_qk_l2norm_in_kernel):
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    groups = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k


def gdn_recurrent(
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
    """S <- e^g S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q, one token at a time."""
    q, k = _prepare(q, k, v, scale, use_qk_l2norm_in_kernel)
    hv, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    outs, finals = [], []
    for n, (s, e) in enumerate(_segments(cu_seqlens, q.shape[1])):
        state = initial_state[n] if initial_state is not None else q.new_zeros(hv, dk, dv)
        for t in range(s, e):
            state = state * g[0, t].exp()[:, None, None]
            u = beta[0, t][:, None] * (v[0, t] - torch.einsum("hk,hkv->hv", k[0, t], state))
            state = state + torch.einsum("hk,hv->hkv", k[0, t], u)
            outs.append(torch.einsum("hk,hkv->hv", q[0, t], state))
        finals.append(state)
    o = torch.stack(outs).unsqueeze(0)
    return o, (torch.stack(finals) if output_final_state else None)


def _gdn_chunked_one(q, k, v, g, beta, state):
    """One sequence, heads first: q, k [H, L, K], v [H, L, V], g, beta [H, L].

    Padded to whole chunks and computed one chunk at a time, so every operation has the same
    shape whatever the sequence length (CPU kernels may round differently across shapes).
    """
    length = q.shape[1]
    pad = (-length) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril(-1)
    eye = torch.eye(CHUNK, dtype=q.dtype)
    outs = []
    for c in range(0, q.shape[1], CHUNK):
        qc, kc, vc = (x[:, c : c + CHUNK].contiguous() for x in (q, k, v))
        gc = g[:, c : c + CHUNK].cumsum(-1)
        bc = beta[:, c : c + CHUNK]
        decay = torch.where(lower, (gc[:, :, None] - gc[:, None, :]).masked_fill(~lower, 0).exp(), 0.0)
        k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
        a = torch.where(strict, (k_beta @ kc.transpose(-1, -2)) * decay, 0.0)
        rows = [eye[0].expand(q.shape[0], CHUNK)]  # (I + A)^-1 by forward substitution
        for i in range(1, CHUNK):
            rows.append(eye[i] - (a[:, i, :i, None] * torch.stack(rows, dim=-2)).sum(-2))
        inv = torch.stack(rows, dim=-2)
        v_new = inv @ v_beta - (inv @ (k_beta * gc.exp()[..., None])) @ state
        inter = (qc * gc.exp()[..., None]) @ state
        intra = torch.where(lower, (qc @ kc.transpose(-1, -2)) * decay, 0.0) @ v_new
        outs.append(inter + intra)
        last = gc[:, -1]
        state = (
            state * last.exp()[:, None, None]
            + (kc * (last[:, None] - gc).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    return torch.cat(outs, dim=1)[:, :length], state


def gdn_chunked(
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
    """Chunked GDN (chunk 64, chunks restart at every sequence start), the way chunked kernels partition."""
    q, k = _prepare(q, k, v, scale, use_qk_l2norm_in_kernel)
    hv, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    outs, finals = [], []
    for n, (s, e) in enumerate(_segments(cu_seqlens, q.shape[1])):
        state = initial_state[n] if initial_state is not None else q.new_zeros(hv, dk, dv)
        heads_first = [x[0, s:e].transpose(0, 1) for x in (q, k, v, g, beta)]
        o, state = _gdn_chunked_one(*heads_first, state)
        outs.append(o.transpose(0, 1))
        finals.append(state)
    o = torch.cat(outs).unsqueeze(0)
    return o, (torch.stack(finals) if output_final_state else None)


def causal_conv1d(x, weight, bias=None, *, activation="silu", cu_seqlens=None):
    """Depthwise causal conv; every sequence starts from zeros."""
    w = weight.shape[-1]
    outs = []
    for s, e in _segments(cu_seqlens, x.shape[1]):
        xs = F.pad(x[0, s:e], (0, 0, w - 1, 0))
        y = sum(xs[j : j + e - s] * weight[:, j] for j in range(w))
        if bias is not None:
            y = y + bias
        outs.append(F.silu(y) if activation in ("silu", "swish") else y)
    return torch.cat(outs).unsqueeze(0)


def attention(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal=True):
    """Varlen attention with grouped K/V heads, causal aligned bottom-right per segment."""
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    groups = q.shape[1] // k.shape[1]
    outs = []
    for (qs, qe), (ks, ke) in zip(_segments(cu_seqlens_q, 0), _segments(cu_seqlens_k, 0)):
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        qq = q[qs:qe].transpose(0, 1)
        kk = k[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
        vv = v[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = (qq @ kk.transpose(-1, -2)) * scale
        lq, lk = qe - qs, ke - ks
        if causal:
            allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ vv).transpose(0, 1))
    return torch.cat(outs)


class Counting:
    """Wraps a backend and counts its calls (kernel launches per layer)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def pack(seqs, position_rows=None):
    """(input_ids [1, T], cu_seqlens int32) of token lists; empty lists give zero-length segments."""
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, cu


def grpo(prompt, responses):
    """prompt + response_i for each response."""
    return [list(prompt) + list(r) for r in responses]


def shifted_labels(seqs, prompt_lengths=None):
    """Next-token labels per packed position, -100 at each sequence's last token and on the first
    `prompt_lengths[i]` label positions of sequence i when given (masked prompt)."""
    out = []
    for i, s in enumerate(seqs):
        lab = list(s[1:]) + [-100] if s else []
        if prompt_lengths is not None:
            lab = [-100] * min(prompt_lengths[i], len(lab)) + lab[prompt_lengths[i] :]
        out += lab
    return torch.tensor(out, dtype=torch.long).reshape(1, -1)


def assert_matches_packed(plan, compact_fn, packed_fn, compact_inputs, params=(), atol=1e-10):
    """Compact path vs packed path on the same data: outputs on every packed row and the gradients of
    every input. The packed inputs are `expand(compact)`, as in the model, where shared rows hold
    identical values; gradients therefore meet at the compact leaves (and the parameters)."""
    out_c = plan.expand(compact_fn(*compact_inputs, *params))
    out_p = packed_fn(*(plan.expand(x) for x in compact_inputs), *params)
    assert out_c.shape == out_p.shape
    torch.testing.assert_close(out_c, out_p, rtol=0, atol=atol)
    weight = torch.randn_like(out_p)
    leaves = [*compact_inputs, *params]
    grads_c = torch.autograd.grad((out_c * weight).sum(), leaves)
    grads_p = torch.autograd.grad((out_p * weight).sum(), leaves)
    for gc, gp in zip(grads_c, grads_p):
        torch.testing.assert_close(gc, gp, rtol=0, atol=atol)
    return out_c, out_p
