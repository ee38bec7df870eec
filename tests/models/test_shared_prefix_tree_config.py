"""Issue 19, item 1: the model config's `shared_prefix_max_depth` reaches the plan the forward builds.

A system prompt over two prompts, two rollouts each: a tree of two levels by default, the
one-level plan (the groups of the prompts) with `shared_prefix_max_depth=1`.
"""

import pytest
import torch
from patchgen.kernels.modeling.shared_prefix import observe_plans
from patchgen.kernels.shared_prefix import DEFAULT_MAX_DEPTH, build_plan

from tests.models import tiny
from tests.models.prefix_trees import pack


def _batch():
    gen = torch.Generator().manual_seed(2)

    def toks(n):
        return torch.randint(0, tiny.VOCAB, (n,), generator=gen).tolist()

    system = toks(64)
    prompts = [system + toks(64), system + toks(65)]
    return pack([p + toks(1 + r) for p in prompts for r in range(2)])


@pytest.fixture(scope="module")
def net():
    return tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_level_cost=0)


def _model_plan(net):
    ids, cu = _batch()
    plans = []
    with torch.no_grad(), observe_plans(lambda plan, tokens: plans.append(plan)):
        net(input_ids=ids, **tiny.packed_kwargs(cu))
    (plan,) = plans
    return plan


def _shape(plan):
    return [(n.members, n.start, n.end, n.parent) for n in plan.nodes]


def test_an_unset_max_depth_shares_the_system_prompt_and_each_prompt(net):
    assert not hasattr(net.config, "shared_prefix_max_depth")
    plan = _model_plan(net)
    assert DEFAULT_MAX_DEPTH >= 2
    assert _shape(plan) == [((0, 1, 2, 3), 0, 64, None), ((0, 1), 64, 128, 0), ((2, 3), 64, 129, 0)]


def test_max_depth_one_in_the_config_builds_the_one_level_plan(net, monkeypatch):
    monkeypatch.setattr(net.config, "shared_prefix_max_depth", 1, raising=False)  # read at every forward
    plan = _model_plan(net)
    assert _shape(plan) == _shape(build_plan(*_batch(), max_depth=1))
    assert _shape(plan) == [((0, 1), 0, 128, None), ((2, 3), 0, 129, None)]
