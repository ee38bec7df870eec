"""Prefix trees end to end: flag on vs off on random trees, all four targets, float64 on CPU (issue 19).

Logits at every packed position, the loss (with the MoE load-balancing loss), and every
parameter gradient to 1e-10, with the prompt masked or labelled and `position_ids` None or given.
The trees are small (a float64 model on two CPU cores): depth 2-3, node lengths 63 / 64 / 65.
"""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from patchgen.kernels.modeling.shared_prefix import observe_plans
from patchgen.kernels.shared_prefix import build_plan

from tests.models import tiny
from tests.models.prefix_trees import pack, prefix_trees, prompt_mask

SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}
TREES = prefix_trees(
    depth=(2, 3),
    fan_out=(2, 2),
    lengths=(63, 64, 65),
    leaf=(1, 3),
    roots=(1, 1),
    spine=True,
    max_sequences=5,
    vocab=tiny.VOCAB,
)
# the NPU target's GDN, conv and gated norm: in this float64 model the dtype dispatch runs the torch
# references (our Triton kernels compute in float16/bfloat16/float32; the float32 tree through them is
# tests/npu/test_shared_prefix_tree_triton.py); one small tree whose nested nodes are kept (64 / 65 rows)
NPU_TREES = prefix_trees(
    depth=(2, 3),
    fan_out=(2, 2),
    lengths=(64, 65),
    leaf=(1, 3),
    roots=(1, 1),
    spine=True,
    max_sequences=4,
    vocab=tiny.VOCAB,
)
TREE_CONFIG = {"shared_prefix_max_depth": 4, "shared_prefix_level_cost": 0}


def _run(model, device, flag, kwargs):
    net = tiny.build(model, device, seed=3, shared_prefix_training=flag, **TREE_CONFIG)
    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        out = net(**kwargs)
    out.loss.backward()
    return out, tiny.grads(net), plans, bool(getattr(net.config, "shared_prefix_chunk_aligned", False))


def _nodes(plan):
    return [(n.members, n.start, n.end, n.parent) for n in plan.nodes]


def check_tree(model, device, batch, masked):
    seqs, prompt_lengths, positions = batch
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, positions, max_depth=4, level_cost=0)
    assert plan is not None and plan.compact_length < plan.packed_length
    labels = ids.masked_fill(prompt_mask(seqs, prompt_lengths), -100) if masked else ids
    kwargs = dict(input_ids=ids, labels=labels, **tiny.packed_kwargs(cu))
    if positions is not None:
        kwargs["position_ids"] = positions
    if model == "qwen3_5_moe":
        kwargs["output_router_logits"] = True  # the loss then carries the load-balancing loss
    (off, g_off, _, _), (on, g_on, ran, aligned) = _run(model, device, False, kwargs), _run(model, device, True, kwargs)
    expected = build_plan(ids, cu, positions, max_depth=4, level_cost=0, chunk_aligned=True) if aligned else plan
    assert len(ran) == 1 and _nodes(ran[0]) == _nodes(expected)  # the model ran this tree, not a flatter plan
    assert on.logits.shape == off.logits.shape == (1, ids.shape[1], tiny.VOCAB)
    torch.testing.assert_close(on.logits, off.logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(on.loss, off.loss, atol=1e-12, rtol=0)
    if model == "qwen3_5_moe":
        torch.testing.assert_close(on.aux_loss, off.aux_loss, atol=1e-12, rtol=0)
    tiny.assert_grads_close(g_on, g_off)
    return plan


def fixed_tree(children, positions=None, seed=0):
    """A 64-row root whose children are `(length, leaves)` nodes (0: a leaf of the root), sequences
    in a scrambled packed order; `positions`: None, or "shifted" M-RoPE rows that do not restart
    per sequence alone (one row counts from 1), as a VL model's rows can."""
    gen = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, tiny.VOCAB, (n,), generator=gen).tolist()

    root, pairs = toks(64), []
    for length, leaves in children:
        head = root + toks(length)
        pairs += [(head + toks(1 + i), len(head)) for i in range(max(leaves, 1))]
    pairs = pairs[1::2] + pairs[::2]
    seqs, prompt_lengths = [s for s, _ in pairs], [p for _, p in pairs]
    rows = None
    if positions == "shifted":
        per_seq = torch.cat([torch.arange(len(s)) for s in seqs])
        rows = per_seq.expand(3, -1).reshape(3, 1, -1).clone()
        rows[1] += 1
    return seqs, prompt_lengths, rows


# examples that every run checks, whatever hypothesis draws: fan-out 3, positions None, prompt labelled
@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
@settings(max_examples=3, **SETTINGS)
@given(batch=TREES, masked=st.booleans())
@example(batch=fixed_tree([(65, 2), (64, 2), (0, 1)]), masked=False)
def test_random_trees_match_packed_gpu_target(float64_router, model, batch, masked):
    check_tree(model, "gpu", batch, masked)


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
@settings(max_examples=1, **SETTINGS)
@given(batch=NPU_TREES, masked=st.booleans())
@example(batch=fixed_tree([(64, 2), (0, 1)], positions="shifted"), masked=True)
def test_random_trees_match_packed_npu_target(float64_router, model, batch, masked):
    assert check_tree(model, "npu", batch, masked).depth >= 2


def test_a_three_level_tree_runs_three_levels_in_the_model(float64_router):
    """A fixed deep case, so the model tests never depend on what hypothesis draws."""
    gen = torch.Generator().manual_seed(5)

    def toks(n):
        return torch.randint(0, tiny.VOCAB, (n,), generator=gen).tolist()

    root, turn1, turn2 = toks(64), toks(65), toks(64)
    seqs = [
        root + toks(2),
        root + turn1 + toks(1),
        root + turn1 + turn2 + toks(3),
        root + turn1 + turn2 + toks(2),
    ]
    plan = check_tree("qwen3_5", "gpu", (seqs, [64, 129, 193, 193], None), masked=True)
    assert plan.depth == 3
