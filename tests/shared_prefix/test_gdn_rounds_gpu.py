"""The one-node GDN path on the GPU at Qwen3.5-4B widths, bf16: its forward is the per-round loop's,
bit for bit, on fla and on our Triton kernels (same kernels on the same rows), and its gradients
are the loop's up to the order of summing replayed rows. Skipped without CUDA."""

import functools

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_gated_delta_rule

from tests.models.prefix_trees import pack
from tests.shared_prefix.test_tree import agentic, tokens

pytestmark = pytest.mark.gpu


def _backends():
    from patchgen.kernels.triton import gated_delta_rule as ours

    found = [pytest.param(ours, id="triton")]
    try:
        from patchgen.kernels.backends.fla import gated_delta_rule as fla
    except ImportError:
        return found
    return [*found, pytest.param(fla, id="fla")]


def _gdn_inputs(c: int) -> list:
    """q, k, v, g, beta of a compact row of `c` rows at Qwen3.5-4B GDN widths (16 key / 32 value heads of 128), bf16."""
    torch.manual_seed(0)
    q, k = (torch.randn(1, c, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, c, 32, 128, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, c, 32, device="cuda"))
    beta = torch.rand(1, c, 32, device="cuda", dtype=torch.bfloat16)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("gdn", _backends())
def test_one_node_forward_is_the_loops_bit_for_bit(gdn):
    ids, cu = pack(agentic(prompt=1000, turns=(130,), last=96, fan=3))  # unaligned ends: tails replayed
    plan = build_plan(ids.cuda(), cu.cuda(), max_depth=4, level_cost=0)
    assert plan.depth == 2
    inputs = _gdn_inputs(plan.compact_length)

    def loop(*args, **kwargs):  # the public function alone: no stages
        return gdn(*args, **kwargs)

    assert getattr(gdn, "rounds", None) is not None
    weight = torch.randn(1, plan.compact_length, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for fn in (gdn, loop):
        out = shared_prefix_gated_delta_rule(plan, fn, *inputs, use_qk_l2norm_in_kernel=True)
        runs.append((out, torch.autograd.grad((out.float() * weight).sum(), inputs)))
    (fused, fused_grads), (looped, looped_grads) = runs
    assert torch.equal(fused, looped)
    for a, b in zip(fused_grads, looped_grads):
        scale = b.float().abs().max().clamp_min(1e-6)
        assert ((a.float() - b.float()).abs().max() / scale).item() < 1e-2


def _per_round_and_joint(backend):
    """(per-round stages, joint stages) of a backend: the path before the joint rounds, and the one after."""
    if backend == "triton":
        from patchgen.kernels.triton.gated_delta_rule.rounds import JointRounds, Rounds

        return Rounds(), JointRounds()
    fla = pytest.importorskip("patchgen.kernels.backends.fla", exc_type=ImportError)
    return fla._Rounds(), fla._JointRounds()


def _tree(rounds):
    if rounds == 2:  # 4 rollouts of an unaligned prompt: its tail replayed per rollout
        return [tokens(1000, 0) + tokens(96 + i, 1 + i) for i in range(4)]
    return agentic(prompt=1000, turns=(130,), last=96, fan=3)  # 3 rounds, unaligned ends


ROUNDS = [("triton", 2), ("triton", 3), ("fla", 2), ("fla", 3)]


@functools.cache
def _joint_and_per_round(backend: str, rounds: int) -> tuple:
    """(per-round, joint, per-round again): each (output, gradients of q, k, v, g, beta), at 4B widths."""
    per_round, joint = _per_round_and_joint(backend)
    ids, cu = pack(_tree(rounds))
    plan = build_plan(ids.cuda(), cu.cuda(), max_depth=4, level_cost=0)
    assert len(plan.gdn.present) == rounds
    inputs = _gdn_inputs(plan.compact_length)
    weight = torch.randn(1, plan.compact_length, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    # the states' and replayed rows' gradients are summed by index_add_, atomic on CUDA unless asked
    # for its deterministic kernel; the per-round path runs twice to show the sums are then reproducible
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for stages in (per_round, per_round, joint, per_round):  # the first compiles and autotunes
            def gdn(*args, **kwargs):
                raise AssertionError("the public function must not be called when the backend has stages")

            gdn.rounds = stages
            out = shared_prefix_gated_delta_rule(plan, gdn, *inputs, use_qk_l2norm_in_kernel=True)
            grads = torch.autograd.grad((out.float() * weight).sum(), inputs)
            runs.append((out, dict(zip(["q", "k", "v", "g", "beta"], grads))))
    finally:
        torch.use_deterministic_algorithms(was)
    return tuple(runs[1:])


def _assert_equal_gradients(names, fused_grads, first_grads):
    for name in names:
        a, b = fused_grads[name], first_grads[name]
        assert torch.equal(a, b), f"d{name}: max |joint - per-round| = {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize(("backend", "rounds"), ROUNDS)
def test_joint_rounds_give_the_per_round_outputs_and_q_k_beta_gradients_bit_for_bit(backend, rounds):
    """The state-free stages once for every round (`forward_rounds` / `backward_rounds`) give the
    per-round stages' outputs bit for bit, and the gradients of q, k and beta: each chunk is computed
    from its own rows. Both paths are deterministic."""
    (first, first_grads), (fused, fused_grads), (again, again_grads) = _joint_and_per_round(backend, rounds)
    assert torch.equal(first, again) and all(torch.equal(first_grads[n], again_grads[n]) for n in first_grads)
    assert torch.equal(fused, first)
    _assert_equal_gradients(("q", "k", "beta"), fused_grads, first_grads)


# fla at three rounds: dv departs by one bf16 rounding at 3 elements, dg (float32) by 1.3e-6 at 893. The probe
# (bench/joint_rounds_probe.py, docs/bench/joint_rounds_probe_NVIDIA_H200.txt) finds every stage equal joint and per
# round, on slices and on copies, and fla's composed per-round backward departing from the same stages composed in
# the same order (on the probe's own upstream gradient: dk at 1 element, dg at 928); not yet traced on this test's
# gradient. Strict: a pass means the departure went, and this mark must go.
_FLA_V_AND_GATE = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="fla at three rounds: dv and dg depart from the per-round path by one rounding; fla's composed "
    "chunk_gated_delta_rule_bwd departs from its own stages composed in the same order on this very gradient "
    "(docs/bench/README.md, ninth session, item 3)",
)


@pytest.mark.parametrize(
    ("backend", "rounds"), [pytest.param(*r, marks=_FLA_V_AND_GATE) if r == ("fla", 3) else r for r in ROUNDS]
)
def test_joint_rounds_give_the_per_round_v_and_gate_gradients_bit_for_bit(backend, rounds):
    (_, first_grads), (_, fused_grads), _ = _joint_and_per_round(backend, rounds)
    _assert_equal_gradients(("v", "g"), fused_grads, first_grads)
