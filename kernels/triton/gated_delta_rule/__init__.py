"""Chunked gated delta rule (chunk 64) in portable Triton: varlen, grouped value heads, dh0 / dht.

Stages, one file each: l2norm, cumsum, wy (UT/WY form inside a chunk), chunk_state (the
inter-chunk recurrence), chunk_output; autograd ties them; reference holds the PyTorch versions.
"""

from __future__ import annotations

import torch

from .._common import shape_cache_get
from .autograd import ChunkGatedDeltaRule
from .rounds import JointRounds
from .varlen import CHUNK, Chunking, make_chunking

__all__ = ["CHUNK", "Chunking", "gated_delta_rule", "make_chunking"]


_BATCH_CHUNKING: dict = {}


def _batch_chunking(B: int, T: int, device: torch.device) -> Chunking:
    """The chunk tables of B rows of T tokens, made once per (B, T, device): nothing of the caller's
    goes into them, and the kernels only read them."""
    def build():
        host = torch.arange(0, (B + 1) * T, T, dtype=torch.int32)
        return make_chunking(host.to(device), cu_seqlens_cpu=host)
    return shape_cache_get(_BATCH_CHUNKING, (B, T, device), build)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None):
    """Gated delta rule over one packed row (or a batch of equal-length rows when cu_seqlens is None).

    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0); g (log-decay), beta: [B, T, HV];
    initial_state: [N, HV, K, V] fp32. Returns (o [B, T, HV, V] in v's dtype, final_state or None).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    if k.shape != q.shape or v.shape[:2] != (B, T) or g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1 (one packed row), got {B}")
        chunking = make_chunking(cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)
    else:
        chunking = _batch_chunking(B, T, q.device)
    if initial_state is not None and initial_state.shape != (chunking.num_seqs, HV, K, V):
        raise ValueError(f"initial_state must be [{chunking.num_seqs}, {HV}, {K}, {V}], "
                         f"got {tuple(initial_state.shape)}")
    scale = float(K ** -0.5 if scale is None else scale)

    def flat(x, *tail):
        return x.reshape(B * T, *tail).contiguous()

    o, final = ChunkGatedDeltaRule.apply(
        flat(q, H, K), flat(k, H, K), flat(v, HV, V), flat(g, HV), flat(beta, HV), scale,
        None if initial_state is None else initial_state.contiguous(), output_final_state,
        use_qk_l2norm_in_kernel, chunking, None)
    return o.view(B, T, HV, V), final


gated_delta_rule.rounds = JointRounds()  # every shared-prefix round of a layer in one autograd node
