"""M1-M4: the mixers on the compact row equal packed execution, outputs and gradients to 1e-10 (float64)."""

import pytest
import torch
from patchgen.kernels.shared_prefix import (
    build_plan,
    shared_prefix_attention,
    shared_prefix_causal_conv1d,
    shared_prefix_gated_delta_rule,
)

F64 = {"dtype": torch.float64}


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 2000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def plan(ref):
    """Group A (P=100, unaligned, one suffix of length 1), group B (P=128, aligned), singletons and a
    zero-length segment, interleaved."""
    pa, pb = tokens(100, 1), tokens(128, 2)
    seqs = [
        pa + tokens(7, 3),
        tokens(20, 4),
        pb + tokens(5, 5),
        pa + [9],
        [],
        pb + tokens(3, 6),
        pa + tokens(12, 7),
        tokens(9, 8),
    ]
    plan = build_plan(*ref.pack(seqs))
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 3, 6), 100), ((2, 5), 128)]
    return plan


def gdn_inputs(c, h=2, hv=4, k=4, v=3):
    q = torch.randn(1, c, h, k, **F64)
    kk = torch.randn(1, c, h, k, **F64)
    vv = torch.randn(1, c, hv, v, **F64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, c, hv, **F64))
    beta = torch.rand(1, c, hv, **F64)
    return [x.requires_grad_() for x in (q, kk, vv, g, beta)]


def test_m1_causal_conv1d(plan, ref):
    x = torch.randn(1, plan.compact_length, 6, **F64, requires_grad=True)
    weight = torch.randn(6, 4, **F64, requires_grad=True)
    bias = torch.randn(6, **F64, requires_grad=True)
    cu = torch.tensor(plan.layout.cu, dtype=torch.int32)
    ref.assert_matches_packed(
        plan,
        lambda x, w, b: shared_prefix_causal_conv1d(plan, ref.causal_conv1d, x, w, b, activation="silu"),
        lambda x, w, b: ref.causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu),
        [x],
        [weight, bias],
    )


def test_m1_conv_wider_than_the_plan_is_refused(plan, ref):
    x = torch.randn(1, plan.compact_length, 2, **F64)
    with pytest.raises(ValueError, match="conv_kernel_size=5"):
        shared_prefix_causal_conv1d(plan, ref.causal_conv1d, x, torch.randn(2, 5, **F64))


def _gdn_packed(gdn_fn, plan):
    cu = torch.tensor(plan.layout.cu, dtype=torch.int32)
    nonempty = torch.tensor(sorted(set(plan.layout.cu)), dtype=torch.int32)  # references skip nothing
    return lambda *xs: gdn_fn(
        *xs, use_qk_l2norm_in_kernel=True, cu_seqlens=nonempty if len(nonempty) else cu
    )[0]


def test_m2_gated_delta_rule_against_recurrent_reference(plan, ref):
    inputs = gdn_inputs(plan.compact_length)
    ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(
            plan, ref.gdn_recurrent, *xs, use_qk_l2norm_in_kernel=True
        ),
        _gdn_packed(ref.gdn_recurrent, plan),
        inputs,
    )


def test_m2_a_backend_that_drops_dh0_gets_the_prefix_gradient_wrong(plan, ref):
    def no_dh0(*args, initial_state=None, **kwargs):
        return ref.gdn_recurrent(
            *args, initial_state=None if initial_state is None else initial_state.detach(), **kwargs
        )

    inputs = gdn_inputs(plan.compact_length)
    with pytest.raises(AssertionError):
        ref.assert_matches_packed(
            plan,
            lambda *xs: shared_prefix_gated_delta_rule(plan, no_dh0, *xs, use_qk_l2norm_in_kernel=True),
            _gdn_packed(ref.gdn_recurrent, plan),
            inputs,
        )


def test_m2_gated_delta_rule_with_chunked_reference_gradients(plan, ref):
    inputs = gdn_inputs(plan.compact_length)
    ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, ref.gdn_chunked, *xs, use_qk_l2norm_in_kernel=True),
        _gdn_packed(ref.gdn_chunked, plan),
        inputs,
    )


def test_m3_aligned_split_is_bit_identical_to_packed(plan, ref):
    with torch.no_grad():
        inputs = gdn_inputs(plan.compact_length)
        split = plan.expand(
            shared_prefix_gated_delta_rule(plan, ref.gdn_chunked, *inputs, use_qk_l2norm_in_kernel=True)
        )
        packed = _gdn_packed(ref.gdn_chunked, plan)(*(plan.expand(x) for x in inputs))
    assert torch.equal(split, packed)


def test_m3_negative_control_exporting_at_p_is_not_bit_identical(ref):
    """Export the state at P (unaligned) and run the suffixes from it: close, but not the packed bits."""
    p, lengths = 100, (40, 35, 50)
    with torch.no_grad():
        prefix = gdn_inputs(p)
        suffixes = [gdn_inputs(r) for r in lengths]
        packed_in = [
            torch.cat([x for s in suffixes for x in (pre, s[i])], dim=1) for i, pre in enumerate(prefix)
        ]
        cu = torch.tensor([0] + [p + r for r in lengths]).cumsum(0).to(torch.int32)
        packed, _ = ref.gdn_chunked(*packed_in, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        packed_suffix = torch.cat([packed[:, cu[j] + p : cu[j + 1]] for j in range(len(lengths))], dim=1)

        _, state_p = ref.gdn_chunked(*prefix, use_qk_l2norm_in_kernel=True, output_final_state=True)
        suffix_in = [torch.cat([s[i] for s in suffixes], dim=1) for i in range(5)]
        cu_s = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        unaligned, _ = ref.gdn_chunked(
            *suffix_in,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_s,
            initial_state=state_p.expand(3, -1, -1, -1),
        )
    torch.testing.assert_close(unaligned, packed_suffix, rtol=0, atol=1e-10)
    assert not torch.equal(unaligned, packed_suffix)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 1), (2, 2)])
def test_m4_attention_with_gqa_and_single_token_suffix(plan, ref, heads, kv_heads):
    c, d = plan.compact_length, 8
    q = torch.randn(1, c, heads, d, **F64, requires_grad=True)
    k = torch.randn(1, c, kv_heads, d, **F64, requires_grad=True)
    v = torch.randn(1, c, kv_heads, d, **F64, requires_grad=True)
    cu = torch.tensor(plan.layout.cu, dtype=torch.int32)
    t = plan.packed_length
    scale = d**-0.5

    def packed(q, k, v):
        return ref.attention(
            q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=t, max_seqlen_k=t, scale=scale
        ).unsqueeze(0)

    ref.assert_matches_packed(
        plan,
        lambda q, k, v: shared_prefix_attention(plan, ref.attention, q, k, v, scale=scale),
        packed,
        [q, k, v],
    )


@pytest.mark.parametrize("with_singleton", [False, True])
def test_prefix_shorter_than_a_chunk_starts_round_b_from_zeros(ref, with_singleton):
    """With min_prefix < 64 a group can have B = 0: its round-B sequences start from zero state;
    without singletons or longer prefixes round A is empty and GDN takes one call."""
    seqs = ref.grpo(tokens(30, 1), [tokens(4, 2), [3]]) + ref.grpo(tokens(100, 3), [tokens(2, 4), [5]])
    if with_singleton:
        seqs = seqs[:2] + [tokens(11, 5)]
    plan = build_plan(*ref.pack(seqs), min_prefix=16)
    assert plan.groups[0].prefix_length == 30
    assert (plan.gdn.round_a is None) == (not with_singleton and len(plan.groups) == 1)
    gdn = ref.Counting(ref.gdn_recurrent)
    ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, gdn, *xs, use_qk_l2norm_in_kernel=True),
        _gdn_packed(ref.gdn_recurrent, plan),
        gdn_inputs(plan.compact_length),
    )
    assert gdn.calls == 2


def test_round_a_is_empty_when_every_prefix_is_short_and_nothing_is_alone(ref):
    seqs = ref.grpo(tokens(30, 1), [tokens(4, 2), [3], tokens(6, 7)])
    plan = build_plan(*ref.pack(seqs), min_prefix=16)
    assert plan.gdn.round_a is None
    gdn = ref.Counting(ref.gdn_recurrent)
    ref.assert_matches_packed(
        plan,
        lambda *xs: shared_prefix_gated_delta_rule(plan, gdn, *xs, use_qk_l2norm_in_kernel=True),
        _gdn_packed(ref.gdn_recurrent, plan),
        gdn_inputs(plan.compact_length),
    )
    assert gdn.calls == 1
