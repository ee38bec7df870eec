"""Naive PyTorch references: the token recurrence, and every stage of the chunked algorithm.

Written for clarity, not speed; differentiable, so the backward stages are checked against
autograd through the forward stage references. Tensors are unbatched: [T, heads, dim], with q
and k already expanded to value heads ([T, HV, K]) where a stage works per value head.
"""

from __future__ import annotations

import itertools

import torch

from .l2norm import EPS
from .varlen import CHUNK


def expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[T, H, K] -> [T, HV, K]: value head j reads key head j // (HV // H)."""
    return x.repeat_interleave(hv // x.shape[1], dim=1)


def _spans(cu_seqlens: torch.Tensor):
    cu = cu_seqlens.tolist()
    return list(itertools.pairwise(cu))


def _chunks(bos: int, eos: int, chunk: int):
    return [(s, min(s + chunk, eos)) for s in range(bos, eos, chunk)]


def l2norm_ref(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gdn_ref(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=False,
                      use_qk_l2norm=False, cu_seqlens=None):
    """Token-by-token gated delta rule. q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV].

    S <- e^{g_t} S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = scale S^T q_t.
    """
    T, HV, V = v.shape
    K = q.shape[-1]
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    outs, finals = [], []
    for n, (bos, eos) in enumerate(_spans(cu_seqlens)):
        S = v.new_zeros(HV, K, V, dtype=acc) if initial_state is None else initial_state[n].to(acc)
        for t in range(bos, eos):
            kt, qt, vt = k[t].to(acc), q[t].to(acc), v[t].to(acc)
            S = S * g[t].to(acc).exp()[:, None, None]
            u = beta[t].to(acc)[:, None] * (vt - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, qt))
        finals.append(S)
    o = torch.stack(outs).to(v.dtype)
    return o, (torch.stack(finals) if output_final_state else None)


def chunk_cumsum_ref(g, cu_seqlens, chunk: int = CHUNK):
    """Chunk-local inclusive cumulative sum of g [T, HV]."""
    parts = [g[s:e].cumsum(0) for bos, eos in _spans(cu_seqlens) for s, e in _chunks(bos, eos, chunk)]
    return torch.cat(parts)


def wy_ref(k, v, beta, gc, cu_seqlens, chunk: int = CHUNK):
    """k: [T, HV, K] (per value head). Returns (A [T, HV, chunk], w [T, HV, K], u [T, HV, V])."""
    _T, HV, _K = k.shape
    As, ws, us = [], [], []
    for bos, eos in _spans(cu_seqlens):
        for s, e in _chunks(bos, eos, chunk):
            n = e - s
            kc, vc, bc, Gc = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), beta[s:e].T, gc[s:e].T
            decay = (Gc[:, :, None] - Gc[:, None, :]).tril(-1).exp().tril(-1)
            L = bc[:, :, None] * decay * (kc @ kc.transpose(1, 2))
            eye = torch.eye(n, dtype=L.dtype, device=L.device)
            A = torch.linalg.solve_triangular(eye + L, eye.expand(HV, n, n), upper=False, unitriangular=True)
            ws.append((A @ (kc * (bc * Gc.exp())[:, :, None])).transpose(0, 1))
            us.append((A @ (vc * bc[:, :, None])).transpose(0, 1))
            As.append(torch.nn.functional.pad(A, (0, chunk - n)).transpose(0, 1))
    return torch.cat(As), torch.cat(ws), torch.cat(us)


def chunk_state_ref(k, w, u, gc, cu_seqlens, *, initial_state=None, chunk: int = CHUNK):
    """k: [T, HV, K]. Returns (h [NT, HV, K, V] chunk-start states, v_new [T, HV, V], final [N, HV, K, V])."""
    _T, HV, K = k.shape
    V = u.shape[-1]
    hs, vns, finals = [], [], []
    for n, (bos, eos) in enumerate(_spans(cu_seqlens)):
        S = u.new_zeros(HV, K, V) if initial_state is None else initial_state[n].to(u.dtype)
        for s, e in _chunks(bos, eos, chunk):
            hs.append(S)
            vn = u[s:e].transpose(0, 1) - w[s:e].transpose(0, 1) @ S
            vns.append(vn.transpose(0, 1))
            Gc = gc[s:e].T
            kd = k[s:e].transpose(0, 1) * (Gc[:, -1:] - Gc).exp()[:, :, None]
            S = S * Gc[:, -1].exp()[:, None, None] + kd.transpose(1, 2) @ vn
        finals.append(S)
    return torch.stack(hs), torch.cat(vns), torch.stack(finals)


def chunk_output_ref(q, k, gc, h, v_new, scale, cu_seqlens, chunk: int = CHUNK):
    """q, k: [T, HV, K]. o = scale (diag(e^G) Q S + ((Q K^T) * D) U) per chunk."""
    outs, i = [], 0
    for bos, eos in _spans(cu_seqlens):
        for s, e in _chunks(bos, eos, chunk):
            qc, kc, Gc = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), gc[s:e].T
            D = (Gc[:, :, None] - Gc[:, None, :]).tril().exp().tril()
            P = (qc @ kc.transpose(1, 2)) * D
            o = (qc * Gc.exp()[:, :, None]) @ h[i] + P @ v_new[s:e].transpose(0, 1)
            outs.append((scale * o).transpose(0, 1))
            i += 1
    return torch.cat(outs)


def chunked_gdn_ref(q, k, v, g, beta, *, scale, initial_state=None, use_qk_l2norm=False, cu_seqlens=None,
                    chunk: int = CHUNK):
    """The chunked algorithm stage by stage in PyTorch; equals recurrent_gdn_ref up to rounding."""
    T, HV, _V = v.shape
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T])
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    gc = chunk_cumsum_ref(g, cu_seqlens, chunk)
    _, w, u = wy_ref(k, v, beta, gc, cu_seqlens, chunk)
    h, v_new, final = chunk_state_ref(k, w, u, gc, cu_seqlens, initial_state=initial_state, chunk=chunk)
    return chunk_output_ref(q, k, gc, h, v_new, scale, cu_seqlens, chunk), final
