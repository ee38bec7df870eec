"""Plan reuse (`shared_prefix/plan_reuse.py`): a micro-batch equal by value to a recent one gets its plan again;
anything else (a token refilled in place, another knob, another level cost) builds anew."""


import numpy as np
import pytest
import torch
from patchgen.kernels.shared_prefix import build_plan
from patchgen.kernels.shared_prefix.plan_reuse import PlanReuse, build_or_reuse
from patchgen.kernels.shared_prefix.positions import positions_from_cu_seqlens

from tests.models import tiny
from tests.shared_prefix.plan_differences import differences

KNOBS = dict(conv_kernel_size=4, min_prefix=64, max_depth=4, level_cost=None, chunk_aligned=False, pad_to_bucket=False, held_buckets=())


def _batch(seed=3):
    ids, cu, _ = tiny.grpo_batch([(130, [7, 12, 5]), (70, [9, 4])], [11], seed=seed)
    return ids, cu


def test_the_same_batch_gets_the_same_plan_and_it_equals_a_fresh_build():
    reuse = PlanReuse()
    ids, cu = _batch()
    first = build_or_reuse(reuse, ids, cu, None, **KNOBS)
    again = build_or_reuse(reuse, ids.clone(), cu.clone(), None, **KNOBS)  # new tensors, same values
    assert again is first and (reuse.hits, reuse.misses) == (1, 1)
    assert not differences(first, build_plan(ids, cu, None, **KNOBS))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_plan_built_from_the_host_copy_equals_a_direct_build_with_positions(dtype):
    ids, cu = _batch()
    positions = positions_from_cu_seqlens(cu, ids.shape[1]).to(dtype)
    reused = build_or_reuse(PlanReuse(), ids, cu, positions, **KNOBS)
    assert not differences(reused, build_plan(ids, cu, positions, **KNOBS))
    assert reused.position_ids.dtype == dtype


def test_a_batch_refilled_in_place_builds_anew():
    reuse = PlanReuse()
    ids, cu = _batch()
    first = build_or_reuse(reuse, ids, cu, None, **KNOBS)
    ids[0, 40] = (ids[0, 40] + 1) % tiny.VOCAB  # inside the first prompt: the same object, another batch
    second = build_or_reuse(reuse, ids, cu, None, **KNOBS)
    assert second is not first and reuse.misses == 2
    assert not differences(second, build_plan(ids, cu, None, **KNOBS))


def test_other_boundaries_or_positions_build_anew():
    reuse = PlanReuse()
    ids, cu = _batch()
    build_or_reuse(reuse, ids, cu, None, **KNOBS)
    moved = cu.clone()
    moved[-2] += 1
    build_or_reuse(reuse, ids, moved, None, **KNOBS)
    positions = positions_from_cu_seqlens(cu, ids.shape[1])
    build_or_reuse(reuse, ids, cu, positions, **KNOBS)
    narrow = build_or_reuse(reuse, ids, cu, positions.int(), **KNOBS)  # equal values, another dtype
    assert (reuse.hits, reuse.misses) == (0, 4)
    assert narrow.position_ids.dtype == torch.int32


@pytest.mark.parametrize(
    "knob, value",
    [("min_prefix", 65), ("max_depth", 1), ("chunk_aligned", True), ("pad_to_bucket", True), ("held_buckets", ((1, 2),)), ("level_cost", 0)],
)
def test_another_knob_builds_anew(knob, value):
    reuse = PlanReuse()
    ids, cu = _batch()
    build_or_reuse(reuse, ids, cu, None, **KNOBS)
    build_or_reuse(reuse, ids, cu, None, **{**KNOBS, knob: value})
    assert reuse.misses == 2 and reuse.hits == 0


def test_a_level_cost_from_the_environment_is_part_of_the_key(monkeypatch):
    reuse = PlanReuse()
    ids, cu = _batch()
    build_or_reuse(reuse, ids, cu, None, **KNOBS)
    monkeypatch.setenv("PATCHGEN_SHARED_PREFIX_LEVEL_COST", "100000")
    build_or_reuse(reuse, ids, cu, None, **KNOBS)
    assert reuse.misses == 2


def test_the_kept_batch_is_a_copy_not_the_callers_cpu_tensor():
    reuse = PlanReuse()
    ids, cu = _batch()
    build_or_reuse(reuse, ids, cu, None, **KNOBS)
    kept_ids = reuse.entries[0][1][1]
    assert not np.shares_memory(kept_ids, ids.numpy())


def test_only_the_last_few_are_kept():
    reuse = PlanReuse(size=2)
    batches = [_batch(seed) for seed in (1, 2, 3)]
    for ids, cu in batches:
        build_or_reuse(reuse, ids, cu, None, **KNOBS)
    build_or_reuse(reuse, *batches[0], None, **KNOBS)  # pushed out by the third
    assert (reuse.hits, reuse.misses) == (0, 4)


# RL scores a micro-batch (old-policy, reference log-probs) under no_grad or inference mode, then trains on it: a
# plan kept from an inference-mode forward must not hold inference tensors, which a training forward cannot save
@pytest.mark.parametrize("scoring", [torch.no_grad, torch.inference_mode])
def test_a_model_scores_then_trains_one_batch_on_one_plan_with_the_same_results(monkeypatch, scoring):
    from patchgen.kernels.modeling import shared_prefix

    built = []
    real = shared_prefix.build_plan
    monkeypatch.setattr(shared_prefix, "build_plan", lambda *a, **k: built.append(1) or real(*a, **k))
    ids, cu = _batch()
    results = {}
    for reuse in (True, False):
        net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_plan_reuse=reuse)
        built.clear()
        with scoring():
            scored = net(input_ids=ids, return_log_probs=True, **tiny.packed_kwargs(cu)).log_probs.clone()
        loss = net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu)).loss
        loss.backward()
        results[reuse] = (len(built), scored, loss.detach(), [p.grad.clone() for p in net.parameters()])
    assert results[True][0] == 1 and results[False][0] == 2
    assert torch.equal(results[True][1], results[False][1]) and torch.equal(results[True][2], results[False][2])
    assert all(torch.equal(a, b) for a, b in zip(results[True][3], results[False][3]))


def test_a_setting_other_than_a_bool_is_refused():
    from patchgen.kernels.config import SettingError, shared_prefix_plan_reuse

    config = tiny.text_config("qwen3_5", shared_prefix_plan_reuse="yes")
    with pytest.raises(SettingError, match="shared_prefix_plan_reuse must be True or False"):
        shared_prefix_plan_reuse(config)


@pytest.mark.parametrize("layout", ["fla", "rows", "x"])
def test_the_conv_state_indices_a_plan_keeps_are_ordinary_tensors_when_first_built_in_inference_mode(layout):
    """A kept plan's conv caches its state gather on first use: built in an inference-mode scoring forward, an
    inference tensor there would break the training forward that reuses the plan (width 3 < the plan's 4: the
    "x" layout's own slice)."""
    ids, cu = _batch()
    plan = build_plan(ids, cu, conv_kernel_size=4)
    with torch.inference_mode():
        kept = plan.conv.state_gather(3, 8, layout)
    assert not any(t.is_inference() for t in kept)
