"""fla's joint rounds (`backends/fla_rounds.py`), structurally, on the CPU: fla's chunk kernels do not run
under Triton's interpreter (its state kernel fails there), so stand-ins with fla's stage signatures
record what they are given. The values are checked on the GPU against the per-round stages, bit for
bit (`test_gdn_rounds_gpu.py::test_joint_rounds_equal_the_per_round_stages_bit_for_bit_at_4b_widths`)."""

import torch
from patchgen.kernels.backends.fla_rounds import FlaJointRounds, FlaStages
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_gated_delta_rule

from tests.models.prefix_trees import pack
from tests.shared_prefix.test_tree import spine

H, HV, K, V = 1, 2, 4, 3


class Recorder:
    """fla's stages by signature: each call is logged as (stage, chunk tables, first row, rows)."""

    def __init__(self, idx):
        self.idx, self.calls = idx, []
        self.finals = []  # final states handed out by fwd_h, in order
        self.dh0s = []  # dh0 handed out by bwd_dhu, in order

    def _log(self, stage, x, cu_seqlens):
        tables = "joint" if cu_seqlens is self.idx.joint.cu_seqlens else next(
            i for i, (rnd, _) in enumerate(self.idx.present) if rnd.cu_seqlens is cu_seqlens)
        first = x.storage_offset() // x.stride(1)  # every input is a row slice of a gathered tensor
        self.calls.append((stage, tables, first, x.shape[1]))

    def _offsets(self, cu_seqlens, chunk_offsets):
        # the state stages read the round's own chunk offsets from the plan (fla would derive and cache them)
        rnd = next(rnd for rnd, _ in self.idx.present if rnd.cu_seqlens is cu_seqlens)
        assert chunk_offsets is rnd.chunk_offsets

    def stages(self):
        def cumsum(g, chunk_size, scale=None, reverse=False, cu_seqlens=None, chunk_indices=None):
            self._log("cumsum_reverse" if reverse else "cumsum", g, cu_seqlens)
            return g.float() * (scale or 1.0)

        def fwd_intra(k, v, g, beta, cu_seqlens, chunk_indices, chunk_size):
            self._log("intra", k, cu_seqlens)
            T = k.shape[1]
            return k.new_ones(1, T, HV, K), v.clone(), k.new_zeros(1, T, HV, 64, dtype=torch.float32)

        def fwd_h(k, w, u, g, initial_state, output_final_state, chunk_size, cu_seqlens, chunk_indices, chunk_offsets):
            self._log("fwd_h", k, cu_seqlens)
            self._offsets(cu_seqlens, chunk_offsets)
            n = len(cu_seqlens) - 1
            self.calls.append(("h0", initial_state))
            final = torch.randn(n, HV, K, V) if output_final_state else None
            if final is not None:
                self.finals.append(final)
            return k.new_zeros(1, len(chunk_indices), HV, K, V), u + 1, final

        def fwd_o(q, k, v, h, g, scale, chunk_size, cu_seqlens, chunk_indices):
            self._log("fwd_o", q, cu_seqlens)
            return v.clone()

        def recompute_w_u(k, v, beta, A, g, cu_seqlens, chunk_indices):
            self._log("recompute_w_u", k, cu_seqlens)
            return k.new_ones(1, k.shape[1], HV, K), v.clone()

        def dv_local(q, k, g, do, scale, chunk_size, cu_seqlens, chunk_indices):
            self._log("dv_local", q, cu_seqlens)
            return do.clone()

        def bwd_dhu(q, k, w, g, h0, dht, do, dv, scale, chunk_size, cu_seqlens, chunk_indices, chunk_offsets):
            self._log("bwd_dhu", q, cu_seqlens)
            self._offsets(cu_seqlens, chunk_offsets)
            self.calls.append(("dht", dht))
            dh0 = None if h0 is None else torch.randn(h0.shape)
            if dh0 is not None:
                self.dh0s.append(dh0)
            return k.new_zeros(1, len(chunk_indices), HV, K, V), dh0, dv

        def dqkwg(q, k, v, w, g, h, dv, do, dh, scale, chunk_size, cu_seqlens, chunk_indices):
            self._log("dqkwg", q, cu_seqlens)
            T = q.shape[1]
            return q.float(), k.float(), w.float(), torch.zeros(1, T, HV)

        def wy_bwd(k, v, beta, A, dw, du, g, cu_seqlens, chunk_indices):
            self._log("wy_bwd", k, cu_seqlens)
            return torch.zeros_like(dw[:, :, :H]), du.clone(), beta.float(), torch.zeros_like(g)

        return FlaStages(chunk_local_cumsum=cumsum, fwd_intra=fwd_intra, fwd_h=fwd_h, fwd_o=fwd_o,
                         recompute_w_u=recompute_w_u, bwd_dv_local=dv_local, bwd_dhu=bwd_dhu, bwd_dqkwg=dqkwg,
                         wy_bwd=wy_bwd, gate_scale=0.5)


def _run():
    ids, cu = pack(spine(3, root=64, node=65, leaf=3))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16)
    c = plan.compact_length
    q, k = (torch.randn(1, c, H, K) for _ in range(2))
    inputs = [q, k, torch.randn(1, c, HV, V), torch.randn(1, c, HV), torch.rand(1, c, HV)]
    inputs = [x.requires_grad_() for x in inputs]

    class Stages(FlaJointRounds):
        def l2norm_fwd(self, x):
            return x, None

        def l2norm_bwd(self, y, rstd, dy, dtype):
            return dy.to(dtype)

    recorder = Recorder(plan.gdn)
    stages = Stages()
    stages.stages = recorder.stages()

    def gdn(*args, **kwargs):
        raise AssertionError("the public function must not be called when the backend has stages")

    gdn.rounds = stages
    out = shared_prefix_gated_delta_rule(plan, gdn, *inputs, use_qk_l2norm_in_kernel=True)
    forward = len(recorder.calls)
    torch.autograd.grad(out.sum(), inputs)
    return plan, recorder, forward


def test_state_free_stages_run_once_over_every_round_and_state_stages_per_round_in_order():
    plan, recorder, forward = _run()
    present = plan.gdn.present
    rows = plan.gdn.joint.rows
    stage_calls = [c for c in recorder.calls[:forward] if c[0] != "h0"]
    per_round = [(s, i, r.start, r.stop - r.start) for i, (_, r) in enumerate(present) for s in ("fwd_h", "fwd_o")]
    assert stage_calls == [("cumsum", "joint", 0, rows), ("intra", "joint", 0, rows), *per_round]


def test_backward_runs_state_stages_in_reverse_between_the_joint_ones():
    plan, recorder, forward = _run()
    present = plan.gdn.present
    rows = plan.gdn.joint.rows
    stage_calls = [c for c in recorder.calls[forward:] if c[0] not in ("h0", "dht")]
    per_round = [(s, i, r.start, r.stop - r.start) for i, (_, r) in reversed(list(enumerate(present)))
                 for s in ("fwd_h", "bwd_dhu", "dqkwg")]
    assert stage_calls == [("recompute_w_u", "joint", 0, rows), ("dv_local", "joint", 0, rows), *per_round,
                           ("wy_bwd", "joint", 0, rows), ("cumsum_reverse", "joint", 0, rows)]


def test_each_round_starts_from_the_previous_rounds_final_states():
    plan, recorder, forward = _run()
    h0s = [c[1] for c in recorder.calls[:forward] if c[0] == "h0"]
    assert h0s[0] is None
    for rnd_i, (rnd, _) in enumerate(plan.gdn.present[1:], start=1):
        expected = recorder.finals[rnd_i - 1].index_select(0, rnd.state_index)
        assert torch.equal(h0s[rnd_i], expected)


def test_each_rounds_dh0_flows_into_the_previous_rounds_dht():
    plan, recorder, forward = _run()
    dhts = [c[1] for c in recorder.calls[forward:] if c[0] == "dht"]  # rounds in reverse
    present = plan.gdn.present
    assert dhts[0] is None  # the last round: nothing after it
    for j, dh0 in enumerate(recorder.dh0s[:-1]):  # dh0 of rounds n-1, ..., 1
        i = len(present) - 1 - j
        rnd, prev = present[i][0], present[i - 1][0]
        expected = torch.zeros(prev.num_sequences, *dh0.shape[1:]).index_add_(0, rnd.state_index, dh0)
        assert torch.equal(dhts[j + 1], expected)
