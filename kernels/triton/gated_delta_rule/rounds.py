"""Our stages for `shared_prefix.gdn_rounds`: the forward and backward the autograd Function calls,
on one round's rows with the plan's chunk tables (no per-call chunking, no validation).

`forward_rounds` / `backward_rounds` run the stages that do not read the state (cumsum, wy; in the
backward wy's backward and the reverse cumsum) once over every round's rows, and only the state
recurrence and the output stage per round. Every stage computes a chunk from that chunk's rows
alone and the joint chunk tables hold each round's own chunks, so the results are those of
`forward` / `backward` per round, bit for bit.
"""

from __future__ import annotations

import torch

from .._common import precision_for
from .autograd import _sum_value_heads, gdn_backward, gdn_forward
from .chunk_output import chunk_output_bwd, chunk_output_fwd
from .chunk_state import chunk_state_bwd, chunk_state_fwd
from .cumsum import chunk_cumsum
from .l2norm import l2norm_bwd, l2norm_fwd
from .varlen import Chunking
from .wy import wy_bwd, wy_fwd


def _chunking(rnd) -> Chunking:
    return Chunking(rnd.cu_seqlens, rnd.chunk_indices, rnd.chunk_offsets, rnd.num_sequences,
                    rnd.chunk_indices.shape[0])


def _rows(x):
    return x.reshape(x.shape[1:])  # [1, T, ...] -> [T, ...]: a view of a contiguous slice


class Rounds:
    plan_tables = True  # every stage reads the round's chunk tables from the plan (`_chunking`)

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


class JointRounds(Rounds):
    """`Rounds` with `forward_rounds` / `backward_rounds`: per layer, 2 + 2 x rounds launches forward
    and 2 + 3 x rounds backward, instead of 4 x rounds and 5 x rounds."""

    def forward_rounds(self, q, k, v, g, beta, scale, idx, h0_of):
        q, k, v, g, beta = map(_rows, (q, k, v, g, beta))
        joint = _chunking(idx.joint)
        gc = chunk_cumsum(g, joint)
        A, w, u = wy_fwd(k, v, beta, gc, joint)
        o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        initial, states = [], None
        for rnd, rows in idx.present:
            h0 = h0_of(rnd, states)
            chunking = _chunking(rnd)
            h, v_new, states = chunk_state_fwd(k[rows], w[rows], u[rows], gc[rows], chunking, initial_state=h0,
                                               output_final_state=rnd.export_state)
            chunk_output_fwd(q[rows], k[rows], gc[rows], h, v_new, scale, chunking, out=o[rows])
            initial.append(h0)
        return o.unsqueeze(0), initial, (gc, A, w, u), None

    def backward_rounds(self, q, k, v, g, beta, scale, idx, initial, saved, meta, do, dht_of):
        gc, A, w, u = saved
        q, k, v, g, beta, do = map(_rows, (q, k, v, g, beta, do))
        T, HV, K = w.shape
        acc = precision_for(k.dtype).acc_torch  # what the state and output backward stages accumulate in
        dq, dk, dw = (torch.empty(T, HV, K, dtype=acc, device=k.device) for _ in range(3))
        dG = torch.empty(T, HV, dtype=acc, device=k.device)
        du = torch.empty(*v.shape, dtype=acc, device=k.device)
        present, dht = idx.present, None
        for i in range(len(present) - 1, -1, -1):
            rnd, rows = present[i]
            h0, chunking = initial[i], _chunking(rnd)
            h, v_new, _ = chunk_state_fwd(k[rows], w[rows], u[rows], gc[rows], chunking, initial_state=h0)
            dh, _, dh0 = chunk_state_bwd(q[rows], k[rows], w[rows], gc[rows], do[rows], scale, chunking, dht=dht,
                                         need_dh0=h0 is not None, du=du[rows])
            chunk_output_bwd(q[rows], k[rows], gc[rows], h, dh, v_new, do[rows], du[rows], scale, chunking,
                             out=(dq[rows], dk[rows], dw[rows], dG[rows]))
            dht = dht_of(i, None if dh0 is None else dh0.to(h0.dtype))
        joint = _chunking(idx.joint)
        dk, dv, dbeta, dG = wy_bwd(k, v, beta, gc, A, dw, du, joint, dk=dk, dg=dG)
        dg = chunk_cumsum(dG, joint, reverse=True)
        H = q.shape[1]
        return (_sum_value_heads(dq, H).unsqueeze(0), _sum_value_heads(dk, H).unsqueeze(0), dv.unsqueeze(0),
                dg.to(g.dtype).unsqueeze(0), dbeta.to(beta.dtype).unsqueeze(0))
