"""Prefix trees: every shared prefix computed once, at every level (issue 19), float64 on CPU."""

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from patchgen.kernels.shared_prefix import (
    build_plan,
    shared_prefix_attention,
    shared_prefix_causal_conv1d,
    shared_prefix_gated_delta_rule,
    shared_prefix_loss,
)

from tests.models.prefix_trees import pack, prefix_trees

F64 = {"dtype": torch.float64}
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 150_000) for _ in range(n)]


def system_prompt_control():
    """2 prompts x 4 rollouts: 1024 shared system rows, 512 own prompt rows, R = 256."""
    system = tokens(1024, 0)
    return [system + tokens(512, 1 + p) + tokens(256, 10 + 4 * p + r) for p in range(2) for r in range(4)]


def agentic(prompt=512, turns=(256, 256), last=128, fan=2):
    """8 rollouts of one prompt, branching in two at every turn (3 turns: two shared, the last own)."""
    seqs, seed = [tokens(prompt, 0)], 1
    for length in (*turns, last):
        grown = []
        for s in seqs:
            for _ in range(fan):
                grown.append(s + tokens(length, seed))
                seed += 1
        seqs = grown
    return seqs


def spine(levels, root=64, node=64, leaf=1):
    """The smallest tree of `levels` levels: at every node one leaf branches off, the last node has two."""
    path, seqs, seed = tokens(root, 0), [], 1
    for level in range(levels):
        if level:
            path = path + tokens(node + level % 2, seed)  # 64 / 65: aligned and unaligned ends
            seed += 1
        seqs.append(path + tokens(leaf, seed))
        seed += 1
    seqs.append(path + tokens(leaf + 1, seed))
    return seqs


def shape(plan):
    return [(n.members, n.start, n.end, n.parent) for n in plan.nodes]


def test_system_prompt_control_compacts_to_4096():
    ids, cu = pack(system_prompt_control())
    tree = build_plan(ids, cu, max_depth=4)
    assert (tree.packed_length, tree.compact_length, tree.depth) == (14336, 4096, 2)
    assert shape(tree) == [
        (tuple(range(8)), 0, 1024, None),
        ((0, 1, 2, 3), 1024, 1536, 0),
        ((4, 5, 6, 7), 1024, 1536, 0),
    ]
    flat = build_plan(ids, cu)  # max_depth=1: today's plan, two groups
    assert flat.compact_length == 5120 and [g.members for g in flat.groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_three_turn_agentic_shape():
    ids, cu = pack(agentic())
    plan = build_plan(ids, cu, max_depth=4)
    assert plan.depth == 3
    assert plan.compact_length == 512 + 2 * 256 + 4 * 256 + 8 * 128
    # two levels: sharing prompt + turn 1 (two roots) and turn 2 saves more than prompt, then turn 1
    two = build_plan(ids, cu, max_depth=2)
    assert two.compact_length == 2 * (512 + 256) + 4 * 256 + 8 * 128
    assert [(len(n.members), n.start, n.end) for n in two.nodes if n.parent is None] == [(4, 0, 768)] * 2


def test_depth_one_reproduces_the_one_level_plan_where_nothing_nests():
    seqs = [tokens(100, 1) + tokens(5 + i, 10 + i) for i in range(3)] + [tokens(30, 4)]
    seqs += [tokens(130, 2) + tokens(3 + i, 20 + i) for i in range(2)]
    ids, cu = pack(seqs)
    flat, deep = build_plan(ids, cu), build_plan(ids, cu, max_depth=4, level_cost=0)
    assert shape(flat) == shape(deep) and deep.depth == 1
    for a, b in [
        (flat.compact_src, deep.compact_src),
        (flat.expand_index, deep.expand_index),
        (flat.gdn.out_index, deep.gdn.out_index),
        (flat.gdn.round_b.src, deep.gdn.round_b.src),
        (flat.conv.src, deep.conv.src),
        (flat.attention.kv_src, deep.attention.kv_src),
        (flat.lm.inverse, deep.lm.inverse),
    ]:
        assert torch.equal(a, b)


@pytest.mark.parametrize("extra, nested", [(63, False), (64, True), (65, True)])
def test_nested_node_shorter_than_a_chunk_is_merged_into_its_children(extra, nested):
    system = tokens(200, 0)
    seqs = [system + tokens(extra, 1 + p) + tokens(4, 10 + 2 * p + r) for p in range(2) for r in range(2)]
    plan = build_plan(*pack(seqs), max_depth=3, level_cost=0)
    assert plan.depth == (2 if nested else 1)
    assert all(n.length >= 64 for n in plan.nodes)


def test_a_level_must_save_more_than_its_cost():
    seqs = [
        tokens(200, 0) + tokens(64, 1 + p) + tokens(4, 10 + 2 * p + r) for p in range(2) for r in range(2)
    ]
    ids, cu = pack(seqs)
    # a second level saves 2 * (2 - 1) * 64 = 128 rows more than one level of the 200 shared rows
    assert build_plan(ids, cu, max_depth=2, level_cost=127).depth == 2
    assert build_plan(ids, cu, max_depth=2, level_cost=128).depth == 1


def test_siblings_that_gain_share_their_parents_rows_though_one_between_them_is_better_alone():
    # Sequences 0 and 2 share 64 rows with the others; 1, 3, 4 share 164 and 1, 3 share 264 more. In
    # sorted order 1, 3, 4 fall between 0 and 2 (65th tokens 1, 2, 3): at two levels, 1, 3, 4 are
    # better alone (a root of 164 rows and a child of 100) than under a root of 64, and 0 and 2
    # still share their 64 rows with each other.
    x, b = tokens(64, 0), tokens(99, 1)
    seqs = [
        x + [1] + tokens(5, 2),
        x + [2] + b + tokens(100, 3) + tokens(5, 4),
        x + [3] + tokens(3, 5),
        x + [2] + b + tokens(100, 3) + tokens(3, 6),
        x + [2] + b + tokens(6, 7),
    ]
    plan = build_plan(*pack(seqs), max_depth=2, level_cost=0)
    assert shape(plan) == [((0, 2), 0, 64, None), ((1, 3, 4), 0, 164, None), ((1, 3), 164, 264, 1)]
    assert plan.packed_length - plan.compact_length == 64 + 2 * 164 + 100


def test_max_depth_caps_the_levels():
    ids, cu = pack(agentic())
    assert [build_plan(ids, cu, max_depth=d).depth for d in (1, 2, 3, 4)] == [1, 2, 3, 3]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_max_depth_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="shared_prefix_max_depth must be an int of at least 1"):
        build_plan(*pack(agentic()), max_depth=bad)


@pytest.mark.parametrize(
    "positions", [torch.zeros(1, 0, dtype=torch.long), torch.zeros(3, 1, 0, dtype=torch.long), None]
)
@pytest.mark.parametrize("depth", [1, 4])
def test_empty_packed_row_plans_nothing(positions, depth):
    ids = torch.zeros(1, 0, dtype=torch.long)
    assert build_plan(ids, torch.zeros(1, dtype=torch.int32), positions, max_depth=depth) is None
    assert build_plan(ids, torch.zeros(2, dtype=torch.int32), positions, max_depth=depth) is None


def _shapes_only_gdn(q, k, v, g, beta, *, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """Outputs of the right shapes and nothing else: this test counts calls (the float64 reference is slow)."""
    n = cu_seqlens.numel() - 1
    return v.clone(), (v.new_zeros(n, v.shape[2], k.shape[3], v.shape[3]) if output_final_state else None)


def _layer_calls(plan, ref):
    gdn, conv, attn = (
        ref.Counting(_shapes_only_gdn),
        ref.Counting(ref.causal_conv1d),
        ref.Counting(ref.attention),
    )
    c = plan.compact_length
    with torch.no_grad():
        shared_prefix_causal_conv1d(plan, conv, torch.randn(1, c, 4, **F64), torch.randn(4, 4, **F64))
        q, k = torch.randn(1, c, 1, 4, **F64), torch.randn(1, c, 1, 4, **F64)
        v = torch.randn(1, c, 2, 2, **F64)
        g, beta = -torch.rand(1, c, 2, **F64), torch.rand(1, c, 2, **F64)
        shared_prefix_gated_delta_rule(plan, gdn, q, k, v, g, beta)
        shared_prefix_attention(plan, attn, q, k, k, scale=0.5)
    return gdn.calls, conv.calls, attn.calls


@pytest.mark.parametrize("fan", [2, 3])
def test_kernel_calls_grow_with_depth_not_with_nodes(ref, fan):
    """GDN one call per level (+1), conv and attention one call, for 8 or 27 leaves."""
    plan = build_plan(*pack(agentic(prompt=64, turns=(64, 64), last=1, fan=fan)), max_depth=4, level_cost=0)
    assert plan.depth == 3 and len(plan.nodes) == 1 + fan + fan * fan
    assert _layer_calls(plan, ref) == (4, 1, 1)


def _check_plan(plan, seqs, ids, positions):
    """The tree's invariants: paths cover every sequence, nodes hold identical rows, C and L formulas."""
    t = ids.shape[1]
    assert torch.equal(plan.expand(plan.compact(ids)), ids)
    if positions is not None:
        assert torch.equal(plan.expand(plan.compact(positions, dim=-1), dim=-1), positions)
    assert plan.compact_length == t - sum((len(n.members) - 1) * n.length for n in plan.nodes)
    children = {}
    for i, n in enumerate(plan.nodes):
        assert len(n.members) >= 2
        if n.parent is None:
            assert n.start == 0 and n.length >= 64
        else:
            parent = plan.nodes[n.parent]
            assert parent.end == n.start and set(n.members) < set(parent.members)
            assert n.length >= 64  # a chunk: children start from a state exported inside their parent
            children.setdefault(n.parent, []).append(i)
        assert all(len(seqs[m]) > n.end for m in n.members)  # every member keeps a leaf row
        assert all(seqs[m][: n.end] == seqs[n.members[0]][: n.end] for m in n.members)
    # the last row of a node is scored once per child (nested node or leaf)
    kids = [
        len(children.get(i, []))
        + len(set(n.members) - {m for c in children.get(i, []) for m in plan.nodes[c].members})
        for i, n in enumerate(plan.nodes)
    ]
    assert plan.lm.length == plan.compact_length + sum(k - 1 for k in kids)
    assert plan.gdn.out_index.unique().numel() == plan.compact_length
    assert plan.conv.out_index.unique().numel() == plan.compact_length
    assert len(plan.gdn.rounds) == plan.depth + 1


@settings(max_examples=60, **SETTINGS)
@given(prefix_trees())
def test_tree_invariants_on_random_trees(batch):
    seqs, _, positions = batch
    ids, cu = pack(seqs)
    for depth in (1, 2, 4):
        plan = build_plan(ids, cu, positions, max_depth=depth, level_cost=0)
        if plan is not None:
            assert plan.depth <= depth
            _check_plan(plan, seqs, ids, positions)


def _gdn_inputs(c, h=2, hv=4, k=4, v=3):
    q, kk = torch.randn(1, c, h, k, **F64), torch.randn(1, c, h, k, **F64)
    vv = torch.randn(1, c, hv, v, **F64)
    g = F.logsigmoid(torch.randn(1, c, hv, **F64))
    beta = torch.rand(1, c, hv, **F64)
    return [x.requires_grad_() for x in (q, kk, vv, g, beta)]


@settings(max_examples=8, **SETTINGS)
@given(prefix_trees(depth=(2, 3), fan_out=(2, 3), lengths=(63, 64, 65, 100), leaf=(1, 3), spine=True))
def test_conv_and_attention_match_packed_on_random_trees(ref, batch):
    """Conv (look-back from the parent) and attention (keys of every ancestor): outputs and every gradient."""
    seqs, _, positions = batch
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, positions, max_depth=4, level_cost=0)
    c, t = plan.compact_length, plan.packed_length
    x = torch.randn(1, c, 3, **F64, requires_grad=True)
    w = torch.randn(3, 4, **F64, requires_grad=True)
    ref.assert_matches_packed(
        plan,
        lambda x, w: shared_prefix_causal_conv1d(plan, ref.causal_conv1d, x, w, None, activation="silu"),
        lambda x, w: ref.causal_conv1d(x, w, None, activation="silu", cu_seqlens=cu),
        [x],
        [w],
    )
    q = torch.randn(1, c, 4, 8, **F64, requires_grad=True)
    k = torch.randn(1, c, 2, 8, **F64, requires_grad=True)
    v = torch.randn(1, c, 2, 8, **F64, requires_grad=True)

    def attention_packed(q, k, v):
        return ref.attention(
            q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=t, max_seqlen_k=t, scale=0.3
        ).unsqueeze(0)

    ref.assert_matches_packed(
        plan,
        lambda q, k, v: shared_prefix_attention(plan, ref.attention, q, k, v, scale=0.3),
        attention_packed,
        [q, k, v],
    )


# the float64 chunked GDN reference is slow on CPU: few, small trees (the fixed cases below go deeper)
@settings(max_examples=3, **SETTINGS)
@given(
    prefix_trees(depth=(2, 3), fan_out=(2, 2), lengths=(63, 64, 65), leaf=(1, 2), roots=(1, 1), spine=True)
)
def test_gated_delta_rule_matches_packed_on_random_trees(ref, batch):
    """Each node from its parent's exported state: outputs bit-identical (chunk-aligned), every gradient through dh0."""
    seqs, _, positions = batch
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, positions, max_depth=4, level_cost=0)
    nonempty = torch.tensor(sorted(set(cu.tolist())), dtype=torch.int32)
    out_c, out_p = ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, ref.gdn_chunked, *xs, use_qk_l2norm_in_kernel=True),
        lambda *xs: ref.gdn_chunked(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=nonempty)[0],
        _gdn_inputs(plan.compact_length),
    )
    assert torch.equal(out_c, out_p)


@pytest.mark.parametrize("prompt", [64, 30])  # 30: a root below a chunk, round 1 starts from zeros
def test_gated_delta_rule_on_a_three_level_tree(ref, prompt):
    ids, cu = pack(spine(3, root=prompt))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16)
    assert plan.depth == 3 and (plan.gdn.round_a is None) == (prompt < 64)
    gdn = ref.Counting(ref.gdn_chunked)
    out_c, out_p = ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, gdn, *xs, use_qk_l2norm_in_kernel=True),
        lambda *xs: ref.gdn_chunked(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0],
        _gdn_inputs(plan.compact_length),
    )
    assert torch.equal(out_c, out_p)
    assert gdn.calls == (3 if prompt < 64 else 4)


def test_a_backend_that_drops_dh0_gets_the_ancestors_gradient_wrong(ref):
    def no_dh0(*args, initial_state=None, **kwargs):
        h0 = None if initial_state is None else initial_state.detach()
        return ref.gdn_chunked(*args, initial_state=h0, **kwargs)

    ids, cu = pack(spine(2))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0)
    assert plan.depth == 2
    with pytest.raises(AssertionError):
        ref.assert_matches_packed(
            plan,
            lambda *xs: shared_prefix_gated_delta_rule(plan, no_dh0, *xs, use_qk_l2norm_in_kernel=True),
            lambda *xs: ref.gdn_chunked(*xs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0],
            _gdn_inputs(plan.compact_length),
        )


@settings(max_examples=12, **SETTINGS)
@given(prefix_trees(depth=(2, 3), spine=True, vocab=50))
def test_lm_rows_and_loss_match_packed_on_random_trees(ref, batch):
    """Per-token log-probs, entropy and the loss with and without prompt labels, and their gradients."""
    seqs, prompt_lengths, positions = batch
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, positions, max_depth=4, level_cost=0)
    if plan is None:
        return
    shift = ref.shifted_labels(seqs)
    for labels in (shift, ref.shifted_labels(seqs, prompt_lengths)):
        hidden = torch.randn(1, plan.compact_length, 5, **F64, requires_grad=True)
        weight = torch.randn(50, 5, **F64, requires_grad=True)
        rows = plan.lm_rows(labels)
        rows.check_labels()
        logits = rows.select(hidden)[0] @ weight.T
        nll = rows.expand(F.cross_entropy(logits, rows.labels, ignore_index=-100, reduction="none"))
        loss = shared_prefix_loss(nll, labels)
        packed_logits = plan.expand(hidden)[0] @ weight.T
        packed_nll = F.cross_entropy(packed_logits, labels[0], ignore_index=-100, reduction="none")
        packed_loss = F.cross_entropy(packed_logits, labels[0], ignore_index=-100)
        torch.testing.assert_close(nll[0], packed_nll, rtol=0, atol=1e-10)
        torch.testing.assert_close(loss, packed_loss, rtol=0, atol=1e-12)
        for a, b in zip(
            torch.autograd.grad(loss, [hidden, weight]), torch.autograd.grad(packed_loss, [hidden, weight])
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_a_chain_of_nested_prefixes_deeper_than_the_solver_takes_keeps_one_level():
    """Sequence i is the first 70 + i tokens of one text plus its own token: a trie 70 levels deep."""
    base = tokens(70 + 70, 0)
    ids, cu = pack([base[: 70 + i] + [0] for i in range(70)])
    flat, deep = build_plan(ids, cu), build_plan(ids, cu, max_depth=4, level_cost=0)
    assert deep.depth == 1 and shape(deep) == shape(flat)
    assert torch.equal(deep.expand(deep.compact(ids)), ids)
