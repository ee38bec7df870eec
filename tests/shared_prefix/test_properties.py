"""Property tests over random packed GRPO-like batches (hypothesis)."""

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_attention, shared_prefix_causal_conv1d

SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}


@st.composite
def packed_batches(draw):
    """Random prompts (some sharing a system prompt, some near-duplicates), n rollouts each,
    singletons, zero-length segments, in random order, with random position layouts."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    min_prefix = draw(st.sampled_from([64, 64, 16]))

    def toks(n):
        return [rng.randrange(1, 500) for _ in range(n)]

    system = toks(draw(st.integers(0, 100)))
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        prompt = (system if draw(st.booleans()) else []) + toks(draw(st.integers(0, 90)))
        for _ in range(draw(st.integers(1, 5))):
            seqs.append(prompt + toks(draw(st.integers(0, 8))))
        if prompt and draw(st.booleans()):  # a near-duplicate: one token changed
            twin = list(prompt) + toks(3)
            twin[rng.randrange(len(prompt))] += 1
            seqs.append(twin)
    seqs += [toks(draw(st.integers(0, 80))) for _ in range(draw(st.integers(0, 3)))]
    seqs += [[] for _ in range(draw(st.integers(0, 2)))]
    rng.shuffle(seqs)

    lengths = [len(s) for s in seqs]
    per_seq = torch.cat([torch.arange(n) for n in lengths]).reshape(1, -1)
    mode = draw(st.sampled_from(["none", "per_sequence", "global", "mrope", "perturbed"]))
    positions = {
        "none": None,
        "per_sequence": per_seq,
        "global": torch.arange(sum(lengths)).reshape(1, -1),
        "mrope": per_seq.expand(3, -1).reshape(3, 1, -1).clone(),
        "perturbed": per_seq.expand(3, -1).reshape(3, 1, -1).clone(),
    }[mode]
    if mode == "perturbed" and sum(lengths):
        positions[rng.randrange(3), 0, rng.randrange(sum(lengths))] += 1
    return seqs, positions, min_prefix


def symbols(seqs, positions):
    """Per sequence, the list of (token, every position row) symbols."""
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    if positions is None:
        pos = [list(range(len(s))) for s in seqs]
        return [[(t, p) for t, p in zip(s, ps)] for s, ps in zip(seqs, pos)]
    rows = positions.reshape(-1, cu[-1]).T.tolist()
    return [[(t, *rows[cu[i] + j]) for j, t in enumerate(s)] for i, s in enumerate(seqs)]


def capped_common_prefix(a, b):
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n - 1)


@settings(max_examples=80, **SETTINGS)
@given(packed_batches())
def test_plan_invariants(ref, batch):
    seqs, positions, min_prefix = batch
    ids, cu = ref.pack(seqs)
    plan = build_plan(ids, cu, positions, min_prefix=min_prefix)
    sym = symbols(seqs, positions)
    shareable = any(
        capped_common_prefix(sym[i], sym[j]) >= min_prefix
        for i in range(len(seqs))
        for j in range(i + 1, len(seqs))
    )
    assert (plan is not None) == shareable
    if plan is None:
        return
    t = ids.shape[1]
    members = [m for g in plan.groups for m in g.members]
    assert len(members) == len(set(members))
    assert [g.members[0] for g in plan.groups] == sorted(g.members[0] for g in plan.groups)
    for g in plan.groups:
        assert len(g.members) >= 2 and list(g.members) == sorted(g.members)
        assert g.prefix_length >= min_prefix
        first = sym[g.members[0]]
        for m in g.members:
            assert len(seqs[m]) >= g.prefix_length + 1  # every member keeps a suffix token
            assert sym[m][: g.prefix_length] == first[: g.prefix_length]  # tokens and every position row

    assert plan.compact_length == t - sum((len(g.members) - 1) * g.prefix_length for g in plan.groups)
    assert torch.equal(plan.expand(plan.compact(ids)), ids)
    if positions is not None:
        assert torch.equal(plan.expand(plan.compact(positions, dim=-1), dim=-1), positions)
    x = torch.randn(1, t, 2, dtype=torch.float64)
    kept = plan.compact_src[plan.expand_index] == torch.arange(t)
    assert int(kept.sum()) == plan.compact_length
    assert torch.equal(plan.expand(plan.compact(x))[0, kept], x[0, kept])
    # each packed row reads a compact row at the same offset of an identical history
    starts = torch.repeat_interleave(cu[:-1].long(), cu.diff().long())
    src = plan.compact_src[plan.expand_index]
    assert torch.equal(src - starts[src], torch.arange(t) - starts)

    assert plan.lm.length == t - sum((len(g.members) - 1) * (g.prefix_length - 1) for g in plan.groups)
    assert plan.attention.cu_seqlens_q[-1] == plan.compact_length
    assert plan.attention.cu_seqlens_k[-1] == plan.attention.kv_src.numel()
    out = plan.gdn.out_index
    assert out.unique().numel() == plan.compact_length
    assert plan.conv.out_index.unique().numel() == plan.compact_length


@settings(max_examples=15, **SETTINGS)
@given(packed_batches())
def test_conv_and_attention_match_packed_on_random_batches(ref, batch):
    seqs, positions, min_prefix = batch
    ids, cu = ref.pack(seqs)
    plan = build_plan(ids, cu, positions, min_prefix=min_prefix)
    if plan is None:
        return
    c, t = plan.compact_length, plan.packed_length
    x = torch.randn(1, c, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    ref.assert_matches_packed(
        plan,
        lambda x, w: shared_prefix_causal_conv1d(plan, ref.causal_conv1d, x, w, None, activation=None),
        lambda x, w: ref.causal_conv1d(x, w, None, activation=None, cu_seqlens=cu),
        [x],
        [w],
    )
    q = torch.randn(1, c, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, c, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, c, 1, 4, dtype=torch.float64, requires_grad=True)
    nonempty = torch.tensor(sorted(set(cu.tolist())), dtype=torch.int32)
    ref.assert_matches_packed(
        plan,
        lambda q, k, v: shared_prefix_attention(plan, ref.attention, q, k, v, scale=0.5),
        lambda q, k, v: ref.attention(
            q[0],
            k[0],
            v[0],
            cu_seqlens_q=nonempty,
            cu_seqlens_k=nonempty,
            max_seqlen_q=t,
            max_seqlen_k=t,
            scale=0.5,
        ).unsqueeze(0),
        [q, k, v],
    )


@settings(max_examples=60, **SETTINGS)
@given(packed_batches())
def test_tree_plans_of_the_same_batches(ref, batch):
    """As a prefix tree (the system prompts of these batches nest): the same rows, positions and gradients."""
    seqs, positions, min_prefix = batch
    ids, cu = ref.pack(seqs)
    flat = build_plan(ids, cu, positions, min_prefix=min_prefix)
    plan = build_plan(ids, cu, positions, min_prefix=min_prefix, max_depth=4, level_cost=0)
    assert (plan is None) == (flat is None)
    if plan is None:
        return
    assert plan.compact_length <= flat.compact_length
    assert torch.equal(plan.expand(plan.compact(ids)), ids)
    if positions is not None:
        assert torch.equal(plan.expand(plan.compact(positions, dim=-1), dim=-1), positions)
    sym = symbols(seqs, positions)
    for node in plan.nodes:
        assert len(node.members) >= 2 and node.length >= (min_prefix if node.parent is None else 64)
        for m in node.members:
            assert len(seqs[m]) > node.end and sym[m][: node.end] == sym[node.members[0]][: node.end]
    assert plan.compact_length == ids.shape[1] - sum((len(n.members) - 1) * n.length for n in plan.nodes)
    x = torch.randn(1, plan.compact_length, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    ref.assert_matches_packed(
        plan,
        lambda x, w: shared_prefix_causal_conv1d(plan, ref.causal_conv1d, x, w, None, activation=None),
        lambda x, w: ref.causal_conv1d(x, w, None, activation=None, cu_seqlens=cu),
        [x],
        [w],
    )
