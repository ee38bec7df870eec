"""The depth A/B bench (`bench/depth_ab.py`): it compares the plans it says it compares and times both depths."""

import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import depth_ab
from patchgen.kernels.shared_prefix import build_plan

from tests.models import tiny


def test_a_one_level_batch_gets_the_same_plan_at_both_depths_and_both_are_timed():
    rows = depth_ab.main(["--tiny", "--layers", "4", "--rounds", "2", "--warmup", "0"])
    assert [r["kind"] for r in rows] == ["train", "logprob"]
    assert all(r["same_plan"] for r in rows)
    assert all(r["one_level_ms"] > 0 and r["tree_ms"] > 0 and r["ratio"] == r["tree_ms"] / r["one_level_ms"] for r in rows)


def test_plan_fields_tell_two_plans_apart():
    ids, cu, _ = tiny.grpo_batch([(130, [7, 12, 5])], [11], seed=1)
    other, cu2, _ = tiny.grpo_batch([(130, [7, 12, 6])], [11], seed=1)
    a, b = build_plan(ids, cu), build_plan(other, cu2)
    assert depth_ab.plan_fields(a) == depth_ab.plan_fields(build_plan(ids.clone(), cu.clone()))
    assert depth_ab.plan_fields(a) != depth_ab.plan_fields(b)
    assert isinstance(depth_ab.plan_fields(a)["compact_src"], list) and torch.is_tensor(a.compact_src)
