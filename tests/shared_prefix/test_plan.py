"""P1-P11: building the plan (section 6 of shared_prefix.md)."""

import numpy as np
import pytest
import torch
from patchgen.kernels.shared_prefix import build_plan
from patchgen.kernels.shared_prefix.rows import Arena


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 2000, (n,), generator=g).tolist()


def saved(plan):
    return sum((len(grp.members) - 1) * grp.prefix_length for grp in plan.groups)


def test_p1_round_trip_and_compact_length(ref):
    seqs = ref.grpo(tokens(150, 1), [tokens(r, 10 + r) for r in (5, 9, 2, 30)])
    ids, cu = ref.pack(seqs)
    plan = build_plan(ids, cu)
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 1, 2, 3), 150)]
    assert plan.packed_length == ids.shape[1]
    assert plan.compact_length == plan.packed_length - 3 * 150
    assert torch.equal(plan.expand(plan.compact(ids)), ids)
    x = torch.randn(1, plan.packed_length, 3, dtype=torch.float64)
    kept = plan.compact_src[plan.expand_index] == torch.arange(plan.packed_length)
    assert torch.equal(plan.expand(plan.compact(x))[0, kept], x[0, kept])
    assert int(kept.sum()) == plan.compact_length


def test_expand_backward_sums_every_member_into_shared_rows(ref):
    seqs = ref.grpo(tokens(70, 1), [[1], [2], [3]])
    plan = build_plan(*ref.pack(seqs))
    xc = torch.zeros(1, plan.compact_length, dtype=torch.float64, requires_grad=True)
    plan.expand(xc).sum().backward()
    assert xc.grad[0, :70].tolist() == [3.0] * 70
    assert xc.grad[0, 70:].tolist() == [1.0] * 3


def test_p2_single_rollout_gives_no_plan(ref):
    assert build_plan(*ref.pack([tokens(200, 1)])) is None
    assert build_plan(*ref.pack([tokens(200, 1), tokens(200, 2)])) is None


def test_p3_different_prompts_give_no_plan(ref):
    seqs = ref.grpo(tokens(100, 1), [[5]]) + ref.grpo(tokens(100, 2), [[5]]) + ref.grpo(tokens(100, 3), [[5]])
    assert build_plan(*ref.pack(seqs)) is None


@pytest.mark.parametrize("shared, expected", [(63, None), (64, 64), (65, 65)])
def test_p4_prefix_threshold(ref, shared, expected):
    common = tokens(shared, 1)
    seqs = [common + tokens(40, 2), common + tokens(40, 3)]
    plan = build_plan(*ref.pack(seqs))
    if expected is None:
        assert plan is None
    else:
        assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 1), expected)]


def test_p5_aligned_prefix_has_no_tail_sequence(ref):
    seqs = ref.grpo(tokens(128, 1), [tokens(5, 2), tokens(3, 3)])
    plan = build_plan(*ref.pack(seqs))
    assert plan.groups[0].prefix_length == 128
    assert plan.gdn.round_a.cu_seqlens.tolist() == [0, 128]
    assert plan.gdn.round_b.cu_seqlens.tolist() == [0, 5, 8]  # suffixes only, no replayed tail
    assert plan.gdn.round_b.src.tolist() == list(range(128, 136))


def test_p6_unaligned_tail_runs_alone_once_and_once_per_member(ref):
    seqs = ref.grpo(tokens(100, 1), [tokens(5, 2), tokens(3, 3), tokens(7, 4)])
    plan = build_plan(*ref.pack(seqs))
    assert plan.gdn.round_a.cu_seqlens.tolist() == [0, 64]
    assert plan.gdn.round_b.cu_seqlens.tolist() == [0, 36, 36 + 41, 36 + 41 + 39, 36 + 41 + 39 + 43]
    tail = list(range(64, 100))
    assert plan.gdn.round_b.src.tolist() == (
        tail + tail + list(range(100, 105)) + tail + list(range(105, 108)) + tail + list(range(108, 115))
    )
    assert plan.gdn.state_index.tolist() == [0, 0, 0, 0]
    assert plan.gdn.round_b.chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]


def test_p7_suffix_of_one_token(ref):
    seqs = ref.grpo(tokens(80, 1), [[7], [8]])
    plan = build_plan(*ref.pack(seqs))
    assert plan.groups[0].prefix_length == 80
    assert plan.compact_length == 82
    assert plan.attention.cu_seqlens_q.tolist() == [0, 80, 81, 82]
    assert plan.attention.cu_seqlens_k.tolist() == [0, 80, 161, 242]
    assert (plan.attention.max_seqlen_q, plan.attention.max_seqlen_k) == (80, 81)


def test_p8_empty_response_and_identical_sequences(ref):
    prompt = tokens(90, 1)
    plan = build_plan(*ref.pack([prompt, prompt, prompt]))
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 1, 2), 89)]
    assert plan.compact_length == 92
    plan = build_plan(*ref.pack([prompt, prompt + tokens(4, 2)]))  # shortest length - 1
    assert plan.groups[0].prefix_length == 89


def test_p9_system_prompt_only_sharing_stays_separate_groups(ref):
    system = tokens(64, 1)
    a, b = system + tokens(100, 2), system + tokens(100, 3)
    resp = [tokens(10, 10 + i) for i in range(4)]
    plan = build_plan(*ref.pack(ref.grpo(a, resp) + ref.grpo(b, resp)))
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 1, 2, 3), 164), ((4, 5, 6, 7), 164)]
    plan = build_plan(*ref.pack(ref.grpo(a, resp) + ref.grpo(b, resp[:1])))
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 1, 2, 3), 164)]
    assert plan.compact_length == plan.packed_length - 3 * 164  # B runs whole


def _positions(seqs):
    return torch.cat([torch.arange(len(s)) for s in seqs]).reshape(1, -1)


def test_p10_per_sequence_positions_share(ref):
    seqs = ref.grpo(tokens(100, 1), [tokens(5, 2), tokens(6, 3)])
    ids, cu = ref.pack(seqs)
    plan = build_plan(ids, cu, _positions(seqs))
    assert plan.groups[0].prefix_length == 100
    assert torch.equal(plan.position_ids, build_plan(ids, cu).position_ids)


def test_p10_a_position_differing_inside_the_prefix_splits(ref):
    seqs = ref.grpo(tokens(100, 1), [tokens(5, i) for i in range(3)])
    ids, cu = ref.pack(seqs)
    pos = _positions(seqs)
    pos[0, cu[1] + 10] += 1  # second sequence: one position differs at offset 10
    plan = build_plan(ids, cu, pos)
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 2), 100)]
    pos[0, cu[2] + 80] += 1  # third: differs at offset 80, still >= 64 shared with the first
    plan = build_plan(ids, cu, pos)
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 2), 80)]


def test_p10_global_arange_shares_nothing(ref):
    seqs = ref.grpo(tokens(100, 1), [tokens(5, 2), tokens(6, 3)])
    ids, cu = ref.pack(seqs)
    assert build_plan(ids, cu, torch.arange(ids.shape[1]).reshape(1, -1)) is None


def test_p10_mrope_rows(ref):
    seqs = ref.grpo(tokens(100, 1), [tokens(5, i) for i in range(3)])
    ids, cu = ref.pack(seqs)
    pos = _positions(seqs).expand(3, -1).reshape(3, 1, -1).clone()
    plan = build_plan(ids, cu, pos)
    assert plan.groups[0].members == (0, 1, 2)
    assert plan.position_ids.shape == (3, 1, plan.compact_length)
    assert torch.equal(plan.expand(plan.position_ids, dim=-1), pos)
    pos[2, 0, cu[1] + 20] += 7  # one M-RoPE row of the second sequence differs
    plan = build_plan(ids, cu, pos)
    assert [g.members for g in plan.groups] == [(0, 2)]


def test_p11_zero_length_segments_and_interleaving(ref):
    pa, pb = tokens(70, 1), tokens(90, 2)
    s1, s2 = tokens(20, 3), tokens(9, 4)
    seqs = [[], pa + [1, 2], s1, [], pb + [3], pa + [4], [], pb + [5, 6], pa + [7, 8, 9], s2, []]
    ids, cu = ref.pack(seqs)
    plan = build_plan(ids, cu)
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((1, 5, 8), 70), ((4, 7), 90)]
    c = cu.tolist()
    expected = (
        list(range(c[1], c[1] + 72))
        + [c[5] + 70]
        + list(range(c[8] + 70, c[8] + 73))  # group A block
        + list(range(c[2], c[3]))  # s1
        + list(range(c[4], c[4] + 91))
        + list(range(c[7] + 90, c[8]))  # group B block
        + list(range(c[9], c[10]))  # s2
    )
    assert plan.compact_src.tolist() == expected
    assert torch.equal(plan.expand(plan.compact(ids)), ids)
    # compact blocks: zero-length singletons keep their (empty) place
    assert plan.cu_seqlens.tolist() == [0, 0, 76, 96, 96, 189, 189, 198, 198]


def test_bad_metadata_is_refused(ref):
    ids, cu = ref.pack(ref.grpo(tokens(70, 1), [[1], [2]]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        build_plan(ids, cu[:-1])
    with pytest.raises(ValueError, match="one packed row"):
        build_plan(ids[0], cu)
    plan = build_plan(ids, cu)
    with pytest.raises(ValueError, match="rows"):
        plan.expand(ids)


def test_packed_upload_gives_the_same_indices(ref):
    """The device path copies all index arrays in one buffer per dtype; its views equal the arrays."""
    from patchgen.kernels.shared_prefix import plan as plan_module

    host = {
        "a": {"x": np.arange(5), "cu": np.array([0, 2, 5], dtype=np.int32), "n": 3},
        "b": {"y": np.ones((2, 3), np.int64)},
        "c": {"z": np.arange(6, dtype=np.int32).reshape(2, 3), "t": np.arange(6).reshape(2, 3).T, "e": np.arange(0)},
    }
    arena = Arena(np.zeros(64, dtype=np.int64))  # and the arrays written into an arena, int32 ones of odd sizes
    in_arena = {name: {k: arena.put(v, v.dtype) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}
                for name, arrays in host.items()}
    assert all(arena.slot_of(v) is not None for arrays in in_arena.values() for v in arrays.values()
               if isinstance(v, np.ndarray))
    loose = plan_module._upload(host, torch.device("cpu"), pack=False)
    for packed in (plan_module._upload(host, torch.device("cpu"), pack=True),
                   plan_module._upload(in_arena, torch.device("cpu"), pack=True, arena=arena)):
        _assert_same_arrays(host, packed, loose)
    meta = plan_module._upload(host, torch.device("meta"))
    assert meta["b"]["y"].shape == (2, 3) and meta["a"]["cu"].dtype == torch.int32


def _assert_same_arrays(host, packed, loose):
    for name, arrays in host.items():
        assert (
            packed[name].keys()
            == loose[name].keys()
            == {k for k, v in arrays.items() if isinstance(v, np.ndarray)}
        )
        for key in packed[name]:
            assert packed[name][key].dtype == loose[name][key].dtype
            assert torch.equal(packed[name][key], loose[name][key])


def test_demo_prints_the_plan(capsys):
    from patchgen.kernels.shared_prefix import demo

    demo.main()
    out = capsys.readouterr().out
    assert out.startswith("Plan(T=") and "GDN round B" in out


def test_cu_seqlens_and_positions_of_other_dtypes(ref):
    seqs = ref.grpo(tokens(70, 1), [[1], [2, 3]])
    ids, cu = ref.pack(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).reshape(1, -1).to(torch.int32)
    plan = build_plan(ids, cu.long(), pos)
    assert plan.groups[0].prefix_length == 70
    assert plan.position_ids.dtype == torch.int32
    assert plan.position_ids.tolist() == [list(range(71)) + [70, 71]]
