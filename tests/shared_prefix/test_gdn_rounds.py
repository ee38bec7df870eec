"""Every GDN round of a layer in one autograd node (`gdn_rounds`): the same outputs and gradients as
packed execution, and as the per-round loop, on every tree shape the plan builds."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_gated_delta_rule
from patchgen.kernels.shared_prefix.gdn_rounds import ReferenceRounds, round_kernels

from tests.models.prefix_trees import pack, prefix_trees
from tests.shared_prefix.test_tree import SETTINGS, agentic, spine

F64 = {"dtype": torch.float64}


def _inputs(c, dtype=torch.float64, h=2, hv=4, k=4, v=3):
    q, kk = torch.randn(1, c, h, k, dtype=dtype), torch.randn(1, c, h, k, dtype=dtype)
    vv = torch.randn(1, c, hv, v, dtype=dtype)
    g = F.logsigmoid(torch.randn(1, c, hv, dtype=dtype))
    beta = torch.rand(1, c, hv, dtype=dtype)
    return [x.requires_grad_() for x in (q, kk, vv, g, beta)]


def _with_rounds(fn, kernels):
    """A backend function carrying stages, as a backend module attaches them."""

    def gdn(*args, **kwargs):
        return fn(*args, **kwargs)

    gdn.rounds = kernels
    return gdn


def _check_against_packed(ref, plan, cu):
    gdn = _with_rounds(ref.gdn_chunked, ReferenceRounds(ref.gdn_chunked))
    out_c, out_p = ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, gdn, *xs, use_qk_l2norm_in_kernel=True),
        lambda *xs: ref.gdn_chunked(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0],
        _inputs(plan.compact_length),
    )
    assert torch.equal(out_c, out_p)


@pytest.mark.parametrize("prompt", [64, 30])  # 30: no round 0, round 1 starts from zeros
def test_one_node_per_layer_matches_packed_on_a_three_level_tree(ref, prompt):
    ids, cu = pack(spine(3, root=prompt))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16)
    assert plan.depth == 3 and (plan.gdn.round_a is None) == (prompt < 64)
    _check_against_packed(ref, plan, cu)


@pytest.mark.parametrize("fan", [2, 3])  # 3: three children start from one exported state
def test_one_node_per_layer_matches_packed_on_an_agentic_tree(ref, fan):
    ids, cu = pack(agentic(prompt=100, turns=(70,), last=5, fan=fan))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0)
    assert plan.depth == 2 and len(plan.nodes) == 1 + fan
    _check_against_packed(ref, plan, cu)


def test_the_per_round_loop_matches_packed_with_three_children_per_node(ref):
    ids, cu = pack(agentic(prompt=100, turns=(70,), last=5, fan=3))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0)
    out_c, out_p = ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, ref.gdn_chunked, *xs, use_qk_l2norm_in_kernel=True),
        lambda *xs: ref.gdn_chunked(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0],
        _inputs(plan.compact_length),
    )
    assert torch.equal(out_c, out_p)


# the float64 chunked reference is slow on CPU: few, small trees (the fixed cases above go deeper)
@settings(max_examples=2, **SETTINGS)
@given(prefix_trees(depth=(2, 3), fan_out=(2, 2), lengths=(63, 64, 65), leaf=(1, 2), roots=(1, 1), spine=True))
def test_one_node_per_layer_matches_packed_on_random_trees(ref, batch):
    seqs, _, positions = batch
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, positions, max_depth=4, level_cost=0)
    assume(plan is not None)
    nonempty = torch.tensor(sorted(set(cu.tolist())), dtype=torch.int32)
    _check_against_packed(ref, plan, nonempty)


def test_the_backend_is_called_once_per_round_in_each_direction(ref):
    """Forward: one stage call per level (+1); backward likewise, in reverse; no public call at all."""
    ids, cu = pack(spine(3))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16)
    calls = []

    class Recording(ReferenceRounds):
        def forward(self, *args):
            calls.append(("forward", args[-1].num_sequences))
            return super().forward(*args)

        def backward(self, *args):
            calls.append(("backward", args[-1].num_sequences))
            return super().backward(*args)

    def public(*args, **kwargs):
        raise AssertionError("the public function must not be called when the backend has stages")

    public.rounds = Recording(ref.gdn_chunked)
    out = shared_prefix_gated_delta_rule(plan, public, *_inputs(plan.compact_length), use_qk_l2norm_in_kernel=True)
    out.sum().backward()
    sizes = [rnd.num_sequences for rnd in plan.gdn.rounds]
    assert calls == [("forward", n) for n in sizes] + [("backward", n) for n in reversed(sizes)]


def test_a_backend_without_stages_takes_the_loop(ref):
    assert round_kernels(ref.gdn_chunked, torch.float64) is None
    assert round_kernels(_with_rounds(ref.gdn_chunked, "stages"), torch.float64) == "stages"


def test_without_l2norm_in_kernel_matches_packed(ref):
    ids, cu = pack(spine(2))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16)
    gdn = _with_rounds(ref.gdn_chunked, ReferenceRounds(ref.gdn_chunked))
    ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, gdn, *xs, use_qk_l2norm_in_kernel=False),
        lambda *xs: ref.gdn_chunked(*xs, cu_seqlens=cu)[0],
        _inputs(plan.compact_length),
    )


def test_our_triton_stages_equal_their_loop(ref):
    """Our Triton backend (interpreted on CPU), float32: the one-node forward is the loop's, bit for bit
    (same kernels on the same rows); gradients differ only in the order replayed rows are summed."""
    from patchgen.kernels.triton import gated_delta_rule

    ids, cu = pack(spine(2, root=64, node=65, leaf=3))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16)
    assert plan.depth == 2
    torch.manual_seed(1)
    inputs = _inputs(plan.compact_length, torch.float32, h=1, hv=2, k=16, v=16)

    def loop(*args, **kwargs):  # the public function alone: no `rounds` attribute
        return gated_delta_rule(*args, **kwargs)

    results = []
    for fn in (gated_delta_rule, loop):
        out = shared_prefix_gated_delta_rule(plan, fn, *inputs, use_qk_l2norm_in_kernel=True)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        results.append((out, torch.autograd.grad((out * weight).sum(), inputs)))
    (fused, fused_grads), (looped, looped_grads) = results
    assert torch.equal(fused, looped)
    for a, b in zip(fused_grads, looped_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _group(prompt, suffixes, first=0):
    return [list(range(first, first + prompt)) + [1000 + 10 * i + j for j in range(n)] for i, n in enumerate(suffixes)]


def test_a_chunk_aligned_group_is_read_in_place():
    """Prefix a multiple of 64, one group: the rounds are the compact row in order, nothing to gather."""
    plan = build_plan(*pack(_group(128, [5, 9, 3])))
    assert plan.gdn.src_identity and plan.gdn.out_identity


@pytest.mark.parametrize(
    "seqs",
    [
        _group(130, [5, 9, 3]),  # unaligned: the tail is replayed per member
        _group(128, [5, 9]) + _group(64, [4, 4], first=500),  # two groups: rounds regroup the row
        _group(128, [5, 9]) + [list(range(700, 740))],  # a singleton after the group runs in round 0
    ],
    ids=["unaligned", "two-groups", "singleton"],
)
def test_rows_are_gathered_when_the_rounds_reorder_or_replay_them(seqs):
    plan = build_plan(*pack(seqs))
    assert not plan.gdn.src_identity


class _ContiguousOnly(ReferenceRounds):
    """Stages that refuse strided rows, as fla's do (its l2norm views its input flat)."""

    def l2norm_fwd(self, x):
        assert x.is_contiguous()
        return super().l2norm_fwd(x)

    def forward(self, *args):
        assert all(t.is_contiguous() for t in args[:5])
        return super().forward(*args)


@pytest.mark.parametrize("stages", [True, False], ids=["one-node", "loop"])
def test_read_in_place_matches_packed_with_q_k_v_split_from_one_row(ref, stages):
    """As in the model, q, k and v are strided views of the conv output; float64, outputs and gradients."""
    ids, cu = pack(_group(128, [5, 9, 3]))
    plan = build_plan(ids, cu)
    assert plan.gdn.src_identity
    gdn = _with_rounds(ref.gdn_chunked, _ContiguousOnly(ref.gdn_chunked)) if stages else ref.gdn_chunked
    h, hv, k, v = 2, 4, 4, 3

    def split(mixed):
        q, kk, vv = torch.split(mixed, [h * k, h * k, hv * v], dim=-1)
        return q.reshape(1, -1, h, k), kk.reshape(1, -1, h, k), vv.reshape(1, -1, hv, v)

    c = plan.compact_length
    mixed = torch.randn(1, c, 2 * h * k + hv * v, **F64).requires_grad_()
    g = F.logsigmoid(torch.randn(1, c, hv, **F64)).requires_grad_()
    beta = torch.rand(1, c, hv, **F64).requires_grad_()
    ref.assert_matches_packed(
        plan,
        lambda m, g, b: shared_prefix_gated_delta_rule(plan, gdn, *split(m), g, b, use_qk_l2norm_in_kernel=True),
        lambda m, g, b: ref.gdn_chunked(*split(m), g, b, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0],
        [mixed, g, beta],
    )
