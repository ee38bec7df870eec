"""Every GDN round of a layer on fla's stage functions, the state-free stages once for all rounds.

fla's `chunk_gated_delta_rule_fwd` / `_bwd` (fla-core 0.6) split into stages that read only one
chunk's rows (the gate cumsum, the fused `kkt` + triangular solve + `w`/`u`, in the backward the
`w`/`u` recompute, the local `dv`, the WY backward and the reverse cumsum) and stages that read the
state (`fwd_h`, `fwd_o`, `bwd_dhu`, `bwd_dqkwg`). Here the first kind runs once over every round's
rows with the plan's joint chunk tables (`GDNIndex.joint`: each round's own chunks), the second per
round in order (forward) or in reverse (backward), as fla's own functions compose them. Every
stage computes a chunk from that chunk's rows, so the results are the per-round calls', bit for
bit, while a layer launches 2 + 2 x rounds stages forward instead of 4 x rounds.

This module does not import fla: the stage functions come in through `stages` (`FlaStages`), which
`backends/fla.py` fills with fla's and a CPU test with stand-ins of the same signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

CHUNK = 64


@dataclass(frozen=True)
class FlaStages:
    """fla's stage functions, by the names fla gives them."""

    chunk_local_cumsum: Callable
    fwd_intra: Callable  # chunk_gated_delta_rule_fwd_intra: (w, u, A)
    fwd_h: Callable  # chunk_gated_delta_rule_fwd_h: (h, v_new, final)
    fwd_o: Callable  # chunk_fwd_o
    recompute_w_u: Callable  # recompute_w_u_fwd: (w, u)
    bwd_dv_local: Callable  # chunk_bwd_dv_local
    bwd_dhu: Callable  # chunk_gated_delta_rule_bwd_dhu: (dh, dh0, dv)
    bwd_dqkwg: Callable  # chunk_bwd_dqkwg: (dq, dk, dw, dg)
    wy_bwd: Callable  # prepare_wy_repr_bwd: (dk, dv, dbeta, dg)
    gate_scale: float  # fla's cumsum scale: its kernels work in log2 (1 / ln 2)


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class FlaJointRounds:
    """`gdn_rounds.JointRounds` on `stages`; mixed into the backend's per-round `_Rounds`.

    Every stage gets its chunk tables from the plan (`chunk_indices`, and `chunk_offsets` for the state
    stages), never from fla's own `prepare_chunk_*`, which caches them by the identity of `cu_seqlens`:
    under CUDA graphs with a padded plan a cached table would be the capture step's (`plan_tables`)."""

    stages: FlaStages
    plan_tables = True

    def forward_rounds(self, q, k, v, g, beta, scale, idx, h0_of):
        with torch.cuda.device(q.device) if q.is_cuda else nullcontext():  # fla launches on the current device
            return self._forward_rounds(q, k, v, g, beta, scale, idx, h0_of)

    def backward_rounds(self, q, k, v, g, beta, scale, idx, initial, saved, meta, do, dht_of):
        with torch.cuda.device(q.device) if q.is_cuda else nullcontext():
            return self._backward_rounds(q, k, v, g, beta, scale, idx, initial, saved, do, dht_of)

    def _forward_rounds(self, q, k, v, g, beta, scale, idx, h0_of):
        st, joint = self.stages, idx.joint
        tables = {"cu_seqlens": joint.cu_seqlens, "chunk_indices": joint.chunk_indices}
        g_cum = st.chunk_local_cumsum(g, chunk_size=CHUNK, scale=st.gate_scale, **tables)
        w, u, A = st.fwd_intra(k=k, v=v, g=g_cum, beta=beta, chunk_size=CHUNK, **tables)
        outputs, initial, states = [], [], None
        for rnd, rows in idx.present:
            h0 = h0_of(rnd, states)
            own = {"cu_seqlens": rnd.cu_seqlens, "chunk_indices": rnd.chunk_indices}
            kr, gr = k[:, rows], g_cum[:, rows]
            h, v_new, states = st.fwd_h(k=kr, w=w[:, rows], u=u[:, rows], g=gr, initial_state=h0,
                                        output_final_state=rnd.export_state, chunk_size=CHUNK,
                                        chunk_offsets=rnd.chunk_offsets, **own)
            outputs.append(st.fwd_o(q=q[:, rows], k=kr, v=v_new, h=h, g=gr, scale=scale, chunk_size=CHUNK, **own))
            initial.append(h0)
        return _cat(outputs).to(v.dtype), initial, (g_cum, A), None

    def _backward_rounds(self, q, k, v, g, beta, scale, idx, initial, saved, do, dht_of):
        st, joint = self.stages, idx.joint
        g_cum, A = saved
        tables = {"cu_seqlens": joint.cu_seqlens, "chunk_indices": joint.chunk_indices}
        w, u = st.recompute_w_u(k=k, v=v, beta=beta, A=A, g=g_cum, **tables)
        dv_local = st.bwd_dv_local(q=q, k=k, g=g_cum, do=do, scale=scale, chunk_size=CHUNK, **tables)
        present, dht = idx.present, None
        parts = [None] * len(present)
        for i in range(len(present) - 1, -1, -1):
            rnd, rows = present[i]
            h0 = initial[i]
            own = {"cu_seqlens": rnd.cu_seqlens, "chunk_indices": rnd.chunk_indices}
            qr, kr, wr, gr, dor = q[:, rows], k[:, rows], w[:, rows], g_cum[:, rows], do[:, rows]
            h, v_new, _ = st.fwd_h(k=kr, w=wr, u=u[:, rows], g=gr, initial_state=h0, output_final_state=False,
                                   chunk_size=CHUNK, chunk_offsets=rnd.chunk_offsets, **own)
            dh, dh0, dv = st.bwd_dhu(q=qr, k=kr, w=wr, g=gr, h0=h0, dht=dht, do=dor, dv=dv_local[:, rows],
                                     scale=scale, chunk_size=CHUNK, chunk_offsets=rnd.chunk_offsets, **own)
            dq, dk, dw, dg = st.bwd_dqkwg(q=qr, k=kr, v=v_new, w=wr, g=gr, h=h, dv=dv, do=dor, dh=dh, scale=scale,
                                          chunk_size=CHUNK, **own)
            parts[i] = (dq, dk, dw, dg, dv)
            dht = dht_of(i, dh0)
        dq, dk, dw, dg, dv = (_cat(list(p)) for p in zip(*parts))
        dk2, dv, db, dg2 = st.wy_bwd(k=k, v=v, beta=beta, A=A, dw=dw, du=dv, g=g_cum, **tables)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = st.chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **tables)
        return dq, dk, dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype)

