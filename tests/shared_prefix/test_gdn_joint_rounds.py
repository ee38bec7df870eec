"""Joint GDN rounds (`JointRounds`): the stages that do not read the state run once over every round's
rows, the state recurrence and the output stage per round; the results are the per-round stages',
bit for bit, on our Triton backend (interpreted on CPU), and the packed reference's in float64."""

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_gated_delta_rule
from patchgen.kernels.shared_prefix.gdn_rounds import loop_forward

from tests.models.prefix_trees import pack
from tests.shared_prefix.test_tree import agentic, spine

PLANS = {  # every node's state feeds two or three sequences; ends at 65 replay a 1-row tail per child
    "two-levels-unaligned": (spine(2, root=64, node=65, leaf=3), 4),
    "three-levels": (spine(3, root=64, node=65, leaf=3), 4),
    "no-round-0": (spine(3, root=30, leaf=3), 4),  # the first shared round starts from zeros
    "three-children": (agentic(prompt=64, turns=(65,), last=3, fan=3), 4),
}


def _plan(name):
    seqs, depth = PLANS[name]
    ids, cu = pack(seqs)
    return build_plan(ids, cu, max_depth=depth, level_cost=0, min_prefix=16), cu


def _inputs(c, dtype, h=1, hv=2, k=16, v=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q, kk = (torch.randn(1, c, h, k, dtype=dtype, generator=gen) for _ in range(2))
    vv = torch.randn(1, c, hv, v, dtype=dtype, generator=gen)
    g = F.logsigmoid(torch.randn(1, c, hv, dtype=dtype, generator=gen))
    beta = torch.rand(1, c, hv, dtype=dtype, generator=gen)
    return [x.requires_grad_() for x in (q, kk, vv, g, beta)]


def _with_rounds(rounds):
    from patchgen.kernels.triton import gated_delta_rule

    def gdn(*args, **kwargs):
        return gated_delta_rule(*args, **kwargs)

    gdn.rounds = rounds
    return gdn


def _run(plan, rounds, inputs):
    out = shared_prefix_gated_delta_rule(plan, _with_rounds(rounds), *inputs, use_qk_l2norm_in_kernel=True)
    weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    return out, torch.autograd.grad((out * weight).sum(), inputs)


def test_the_plan_holds_every_rounds_chunks_as_one_varlen_row():
    plan, _ = _plan("three-levels")
    idx = plan.gdn
    assert len(idx.present) == 4 and idx.joint.rows == idx.src.numel() == sum(r.rows for r, _ in idx.present)
    cu, chunks, offsets, sequences, chunk_count = [0], [], [0], 0, 0
    for rnd, rows in idx.present:
        assert rows.stop - rows.start == rnd.rows
        cu += (rnd.cu_seqlens_cpu[1:] + rows.start).tolist()
        chunks += (rnd.chunk_indices.cpu() + torch.tensor([sequences, 0], dtype=torch.int32)).tolist()
        offsets += (rnd.chunk_offsets.cpu()[1:] + chunk_count).tolist()
        sequences += rnd.num_sequences
        chunk_count += rnd.chunk_indices.shape[0]
    assert idx.joint.cu_seqlens.tolist() == idx.joint.cu_seqlens_cpu.tolist() == cu
    assert idx.joint.chunk_indices.tolist() == chunks
    assert idx.joint.chunk_offsets.tolist() == offsets
    assert idx.joint.num_sequences == sequences


# the interpreter is slow on 2 cores: two trees cover the cases (3 rounds, the first shared one from
# zeros, a replayed tail; round 0, three children of one state, a replayed tail)
@pytest.mark.parametrize("name", ["no-round-0", "three-children"])
def test_joint_rounds_equal_the_per_round_stages_bit_for_bit(name):
    from patchgen.kernels.triton.gated_delta_rule.rounds import JointRounds, Rounds

    plan, _ = _plan(name)
    inputs = _inputs(plan.compact_length, torch.float32)
    (joint, joint_grads), (looped, looped_grads) = _run(plan, JointRounds(), inputs), _run(plan, Rounds(), inputs)
    assert torch.equal(joint, looped)
    for a, b in zip(joint_grads, looped_grads):
        assert torch.equal(a, b)


def test_joint_rounds_equal_the_per_round_stages_in_bfloat16_without_l2norm():
    """The model's dtype (bf16 inputs, fp32 states and accumulators) and the path without the l2norm,
    where dq and dk leave the stages as they are."""
    from patchgen.kernels.triton.gated_delta_rule.rounds import JointRounds, Rounds

    plan, _ = _plan("two-levels-unaligned")
    inputs = _inputs(plan.compact_length, torch.bfloat16)
    outputs = []
    for rounds in (JointRounds(), Rounds()):
        out = shared_prefix_gated_delta_rule(plan, _with_rounds(rounds), *inputs, use_qk_l2norm_in_kernel=False)
        weight = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
        outputs.append((out, torch.autograd.grad((out * weight).sum(), inputs)))
    (joint, joint_grads), (looped, looped_grads) = outputs
    assert joint.dtype == torch.bfloat16 and torch.equal(joint, looped)
    for a, b, x in zip(joint_grads, looped_grads, inputs):
        assert a.dtype == x.dtype and torch.equal(a, b)


def test_joint_rounds_match_packed_execution_in_float64(ref):
    from patchgen.kernels.triton.gated_delta_rule.rounds import JointRounds

    plan, cu = _plan("three-levels")
    gdn = _with_rounds(JointRounds())
    ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, gdn, *xs, use_qk_l2norm_in_kernel=True),
        lambda *xs: ref.gdn_chunked(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0],
        _inputs(plan.compact_length, torch.float64, h=1, hv=2, k=4, v=3),
    )


def test_our_backend_offers_the_joint_rounds():
    from patchgen.kernels.triton import gated_delta_rule
    from patchgen.kernels.triton.gated_delta_rule.rounds import JointRounds

    assert isinstance(gated_delta_rule.rounds, JointRounds)


def test_the_loop_is_the_default_for_stages_without_joint_rounds(ref):
    """A backend with per-round stages only gets `loop_forward`: one `forward` per round."""
    from patchgen.kernels.shared_prefix.gdn_rounds import ReferenceRounds

    plan, _ = _plan("two-levels-unaligned")
    stages = ReferenceRounds(ref.gdn_chunked)
    assert not hasattr(stages, "forward_rounds")
    calls = []
    inputs = _inputs(plan.compact_length, torch.float64, h=2, hv=4, k=4, v=3)
    q, k, v, g, beta = (x.detach().index_select(1, plan.gdn.src) for x in inputs)  # every round's rows

    def h0_of(rnd, states):
        calls.append(rnd.num_sequences)
        return None if states is None else states.index_select(0, rnd.state_index)

    o, initial, _, _ = loop_forward(stages, q, k, v, g, beta, 0.5, plan.gdn, h0_of)
    assert calls == [rnd.num_sequences for rnd, _ in plan.gdn.present] and len(initial) == len(calls)
    assert o.shape[1] == plan.gdn.joint.rows
