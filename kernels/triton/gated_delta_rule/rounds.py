"""Our stages for `shared_prefix.gdn_rounds`: the forward and backward the autograd Function calls,
on one round's rows with the plan's chunk tables (no per-call chunking, no validation)."""

from __future__ import annotations

from .autograd import gdn_backward, gdn_forward
from .l2norm import l2norm_bwd, l2norm_fwd
from .varlen import Chunking


def _chunking(rnd) -> Chunking:
    return Chunking(rnd.cu_seqlens, rnd.chunk_indices, rnd.chunk_offsets, rnd.num_sequences,
                    rnd.chunk_indices.shape[0])


def _rows(x):
    return x.reshape(x.shape[1:])  # [1, T, ...] -> [T, ...]: a view of a contiguous slice


class Rounds:
    def l2norm_fwd(self, x):
        return l2norm_fwd(x)

    def l2norm_bwd(self, y, rstd, dy, dtype):
        return l2norm_bwd(y, rstd, dy, dtype)

    def forward(self, q, k, v, g, beta, scale, h0, rnd):
        o, final, gc, A, w, u = gdn_forward(*map(_rows, (q, k, v, g, beta)), scale, h0, rnd.export_state,
                                            _chunking(rnd))
        return o.unsqueeze(0), final, (gc, A, w, u)

    def backward(self, q, k, v, g, beta, scale, h0, saved, do, dht, rnd):
        gc, A, w, u = saved
        dq, dk, dv, dg, dbeta, dh0 = gdn_backward(
            *map(_rows, (q, k, v, g, beta)), scale, h0, gc, A, w, u, _rows(do), dht, h0 is not None,
            _chunking(rnd))
        if dh0 is not None:
            dh0 = dh0.to(h0.dtype)
        return (dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0), dg.to(g.dtype).unsqueeze(0),
                dbeta.to(beta.dtype).unsqueeze(0), dh0)
