"""The padded plan against the padding as first written (`padding_reference.py`), field by field: every index
tensor (values, dtype, shape), every host int and flag, the bucket. The fast padding may build its arrays any
way it likes; what it builds must be exactly this."""

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from patchgen.kernels.shared_prefix import build_plan

from tests.shared_prefix.padding_reference import reference_padded_plan
from tests.shared_prefix.plan_differences import differences
from tests.shared_prefix.references import pack
from tests.shared_prefix.test_bucket import _row, _tree_row
from tests.shared_prefix.test_properties import SETTINGS, packed_batches


def assert_padded_as_reference(ids, cu, positions=None, held=(), **kwargs):
    plain = build_plan(ids, cu, positions, **kwargs)
    if plain is None:
        assert build_plan(ids, cu, positions, pad_to_bucket=True, held_buckets=held, **kwargs) is None
        return None
    padded = build_plan(ids, cu, positions, pad_to_bucket=True, held_buckets=held, **kwargs)
    assert differences(padded, reference_padded_plan(plain, held)) == []
    return padded


def test_the_comparison_sees_a_changed_index():
    ids, cu = _row([(70, [5, 9, 3])])
    padded = build_plan(ids, cu, pad_to_bucket=True)
    expected = reference_padded_plan(build_plan(ids, cu))
    assert differences(padded, expected) == []
    expected.gdn.rounds[1].src[-1] += 1
    expected.conv.state_rows[0, 0] = 5
    assert differences(padded, expected) == ["plan.gdn.rounds[1].src", "plan.conv.state_rows"]
    as_int32 = dataclasses.replace(expected.attention, kv_src=expected.attention.kv_src.to(torch.int32))
    assert differences(expected.attention, as_int32) == ["plan.kv_src"]


@pytest.mark.parametrize(
    ("groups", "singles", "kwargs"),
    [
        ([(70, [5, 9, 3])], (), {}),
        ([(130, [40, 3, 77, 1]), (64, [12, 20])], (9, 70), {}),
        ([(100, [66, 5])], (130,), {"chunk_aligned": True}),
        ([(2048, [256] * 4)], (), {"max_depth": 3}),
        ([(4096, [256] * 8)], (), {}),
        ([(40, [5, 9])], (100, 3), {"min_prefix": 16}),  # round 0 holds no root (the prompt is under a chunk)
    ],
    ids=["grpo", "groups+singles", "chunk-aligned", "n4-P2048", "n8-P4096", "short-root"],
)
def test_a_padded_plan_is_the_reference_padding(groups, singles, kwargs):
    ids, cu = _row(groups, singles)
    assert_padded_as_reference(ids, cu, **kwargs)


def test_a_padded_tree_plan_is_the_reference_padding():
    ids, cu = _tree_row()
    padded = assert_padded_as_reference(ids, cu, max_depth=2, level_cost=0)
    assert padded.depth == 2


def test_a_plan_padded_to_held_buckets_is_the_reference_padding():
    ids, cu = _row([(70, [5, 9, 3])])
    held = tuple(
        build_plan(*_row(groups), pad_to_bucket=True).bucket
        for groups in ([(90, [12, 9, 6])], [(300, [120, 90, 60])], [(66, [1, 2, 3])], [(200, [10, 20, 15])], [(170, [40, 50, 45])])
    )
    for some in (held[:1], held[1:3], held, held[3:], held[3:4], (held[0], held[3])):
        assert_padded_as_reference(*_row([(170, [40, 50, 45])]), held=some)
        assert_padded_as_reference(ids, cu, held=some)


@settings(max_examples=60, **SETTINGS)
@given(packed_batches(), st.integers(1, 3), st.booleans(), st.integers(0, 2))
def test_random_padded_plans_are_the_reference_padding(batch, depth, aligned, held_count):
    seqs, positions, min_prefix = batch
    ids, cu = pack(seqs)
    kwargs = {"min_prefix": min_prefix, "max_depth": depth, "level_cost": 0, "chunk_aligned": aligned}
    # held buckets: those of the same batch with every sequence a few tokens longer, or shorter
    held = []
    for extra in (5, -3)[:held_count]:
        other = [list(x) + [7] * extra if extra > 0 else list(x)[: max(0, len(x) + extra)] for x in seqs]
        plan = build_plan(*pack(other), pad_to_bucket=True, **kwargs)
        if plan is not None:
            held.append(plan.bucket)
    assert_padded_as_reference(ids, cu, positions, tuple(held), **kwargs)


@pytest.mark.parametrize("rows", ["int32", "mrope-int32", "mrope-offset"])
def test_padded_positions_keep_their_rows_and_dtype(rows):
    ids, cu = _row([(130, [40, 3, 77, 1]), (64, [12, 20])], (9, 70))
    per = torch.cat([torch.arange(int(b - a)) for a, b in itertools.pairwise(cu.tolist())])
    mrope = per.expand(3, -1).reshape(3, 1, -1)
    positions = {
        "int32": per.reshape(1, -1).to(torch.int32),
        "mrope-int32": mrope.to(torch.int32).contiguous(),
        "mrope-offset": (mrope + torch.tensor([0, 1, 2]).reshape(3, 1, 1)).contiguous(),  # rows off the offset
    }[rows]
    padded = assert_padded_as_reference(ids, cu, positions, max_depth=2, level_cost=0)
    assert padded.position_ids.dtype == positions.dtype and padded.position_ids.shape[:-1] == positions.shape[:-1]
