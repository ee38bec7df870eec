"""flash-linear-attention (fla-core 0.6) behind the gated_delta_rule, causal_conv1d and rms_norm_gated slots."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from fla.modules.causal_conv1d import causal_conv1d as _fla_causal_conv1d
from fla.modules.causal_conv1d import causal_conv1d_bwd as _fla_conv_bwd
from fla.modules.causal_conv1d import causal_conv1d_fwd as _fla_conv_fwd
from fla.modules.norm.fused_norm_gate import rms_norm_gated as _fla_rms_norm_gated
from fla.modules.norm.l2norm import l2norm_bwd as _fla_l2norm_bwd
from fla.modules.norm.l2norm import l2norm_fwd as _fla_l2norm_fwd
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu as _fla_bwd_dhu
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h as _fla_fwd_h
from fla.ops.common.chunk_o import chunk_bwd_dqkwg as _fla_bwd_dqkwg
from fla.ops.common.chunk_o import chunk_bwd_dv_local as _fla_bwd_dv_local
from fla.ops.common.chunk_o import chunk_fwd_o as _fla_fwd_o
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated_delta_rule
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd as _fla_gdn_bwd
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd as _fla_gdn_fwd
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra as _fla_fwd_intra
from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd as _fla_wy_bwd
from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd as _fla_recompute_w_u
from fla.ops.utils import chunk_local_cumsum as _fla_chunk_local_cumsum
from fla.ops.utils.constant import RCP_LN2 as _FLA_RCP_LN2

from .fla_rounds import FlaJointRounds, FlaStages


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
    """fla's chunked GDN; pass ``cu_seqlens_cpu`` and ``chunk_indices`` to spare it a host sync."""
    o, final = _fla_chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
    )
    return o, (final if output_final_state else None)


def causal_conv1d(
    x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None, cu_seqlens_cpu=None,
    chunk_indices=None,
):
    """fla's varlen depthwise conv (Triton backend); the final conv state is dropped.

    ``initial_state: [N, W-1, D]`` (the slot's layout, rows in time order) goes to fla as its
    ``[N, D, W]`` (slot 0 unread); fla returns its gradient. Without ``chunk_indices`` (its 64-row
    chunks, the GDN slot's layout) fla derives them from ``cu_seqlens`` with a host sync, once per
    boundaries tensor it has not seen.
    """
    if initial_state is not None:
        initial_state = F.pad(initial_state.transpose(1, 2), (1, 0))
    y, _ = _fla_causal_conv1d(
        x, weight, bias, activation=activation, cu_seqlens=cu_seqlens, initial_state=initial_state,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
    )
    return y


def _on(device: torch.device):
    """fla launches on the current CUDA device, as its own guard ensures (nothing to set on the CPU interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _LookBack:
    """fla's conv forward and backward for `shared_prefix.conv.LookBackConv`, with the plan's chunk
    table (no per-call chunk indices); the state in fla's own layout `[N, D, W]`, slot 0 unread."""

    layout = "fla"
    plan_tables = True  # the plan's segment boundaries and chunk table, nothing derived and cached: capturable

    def forward(self, x, weight, bias, state, idx, activation):
        with _on(x.device):
            y, _ = _fla_conv_fwd(
                x=x, weight=weight, bias=bias, residual=None, initial_state=state, output_final_state=False,
                activation=activation, cu_seqlens=idx.segment_cu, chunk_indices=idx.segment_chunks,
            )
        return y

    def backward(self, x, weight, bias, state, dy, idx, activation):
        with _on(x.device):
            dx, dweight, dbias, _, dstate = _fla_conv_bwd(
                x=x, dy=dy, dht=None, weight=weight, bias=bias, residual=None, initial_state=state,
                activation=activation, cu_seqlens=idx.segment_cu, chunk_indices=idx.segment_chunks,
            )
        return dx, dweight, dbias, dstate


# Checked on the H200 against the gathered look-back rows and packed (tests/shared_prefix/
# test_conv_state_gpu.py, 2026-12-01); under Triton's interpreter only with a patched copy of fla (its
# compute_dh0 kernel does not run there as shipped). PATCHGEN_FLA_CONV_LOOK_BACK=0 keeps the gathered
# look-back rows (the path measured before, for A/B runs).
CONV_LOOK_BACK = _LookBack()
if os.environ.get("PATCHGEN_FLA_CONV_LOOK_BACK") != "0":
    causal_conv1d.look_back = CONV_LOOK_BACK


def rms_norm_gated(x, gate, weight, eps):
    """fla's fused ``weight * norm(x) * silu(gate)``; ``eps`` is passed through (fla's module default is 1e-5)."""
    return _fla_rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)


class _Rounds:
    """fla's forward and backward stages for `shared_prefix.gdn_rounds` (the functions its autograd
    Function calls, with the plan's chunk indices and no per-call validation). fla's composed forward and
    backward derive `chunk_offsets` from `cu_seqlens` and cache it by tensor identity, so a padded plan
    (CUDA graphs with buckets) refuses these stages: `_JointRounds` passes the plan's."""

    plan_tables = False

    def l2norm_fwd(self, x):
        return _fla_l2norm_fwd(x)

    def l2norm_bwd(self, y, rstd, dy, dtype):
        return _fla_l2norm_bwd(y, rstd, dy).to(dtype)

    def forward(self, q, k, v, g, beta, scale, h0, rnd):
        with torch.cuda.device(q.device):  # fla launches on the current device, as its own guard ensures
            return self._forward(q, k, v, g, beta, scale, h0, rnd)

    def backward(self, q, k, v, g, beta, scale, h0, saved, do, dht, rnd):
        with torch.cuda.device(q.device):
            return self._backward(q, k, v, g, beta, scale, h0, saved, do, dht, rnd)

    def _forward(self, q, k, v, g, beta, scale, h0, rnd):
        g_cum, o, A, final, _, _ = _fla_gdn_fwd(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0,
            output_final_state=rnd.export_state, cu_seqlens=rnd.cu_seqlens, chunk_indices=rnd.chunk_indices,
        )
        return o.to(v.dtype), final, (g_cum, A)

    def _backward(self, q, k, v, g, beta, scale, h0, saved, do, dht, rnd):
        g_cum, A = saved
        dq, dk, dv, db, dg, dh0, _, _ = _fla_gdn_bwd(
            q=q, k=k, v=v, g=g_cum, beta=beta, A=A, scale=scale, initial_state=h0, do=do, dht=dht,
            cu_seqlens=rnd.cu_seqlens, chunk_indices=rnd.chunk_indices,
        )
        return dq, dk, dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype), dh0


class _JointRounds(FlaJointRounds, _Rounds):
    """`_Rounds` with every round's state-free stages in one launch each (`fla_rounds.py`)."""

    plan_tables = True

    stages = FlaStages(
        chunk_local_cumsum=_fla_chunk_local_cumsum, fwd_intra=_fla_fwd_intra, fwd_h=_fla_fwd_h, fwd_o=_fla_fwd_o,
        recompute_w_u=_fla_recompute_w_u, bwd_dv_local=_fla_bwd_dv_local, bwd_dhu=_fla_bwd_dhu,
        bwd_dqkwg=_fla_bwd_dqkwg, wy_bwd=_fla_wy_bwd, gate_scale=_FLA_RCP_LN2,
    )


# The joint stages equal fla's per-round stages bit for bit on the H200 at two rounds (tests/shared_prefix/
# test_gdn_rounds_gpu.py). At three rounds the v and gate gradients depart by one rounding (outputs, dq, dk, dbeta
# stay bit-equal). bench/joint_rounds_probe.py: every stage, joint or per round, on slices or on copies, gives the
# same bits, and fla's `chunk_gated_delta_rule_bwd` departs from those same stages composed in the same order (on
# the probe's own gradient: dk at 1 element, dg at 928), the likely source; not yet traced on the test's gradient.
# Both paths are deterministic. On the CPU they are order-checked with stand-ins only (fla's state kernel does not
# run under Triton's interpreter). PATCHGEN_FLA_JOINT_ROUNDS=0 keeps the per-round stages.
gated_delta_rule.rounds = _Rounds() if os.environ.get("PATCHGEN_FLA_JOINT_ROUNDS") == "0" else _JointRounds()
