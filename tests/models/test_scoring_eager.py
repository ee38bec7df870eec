"""`shared_prefix_cuda_graphs_scoring`: with the graphs on, a scoring forward replays a graph on a plan padded to a
bucket ("graphs", the default) or runs its layer stack eagerly on the unpadded plan ("eager": long rows, where the
bucket's padding costs more device time than the eager launches cost host time). CPU, float64, `EagerReplay`:
an eager scoring call pads nothing and captures nothing, training steps still replay, and both ways give the
logits of the model without graphs."""

import pytest
import torch
from patchgen.kernels.errors import SettingError
from patchgen.kernels.graphs import EagerReplay
from patchgen.kernels.modeling import layer_graphs, shared_prefix

from tests.models import tiny

GROUP = [(70, [5, 9, 3])]


def _batch(seed):
    ids, cu, _ = tiny.grpo_batch(GROUP, seed=seed)
    return ids, tiny.packed_kwargs(cu)


def _models(**extra):
    plain = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    graphed = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_cuda_graphs=True, **extra)
    graphs = layer_graphs.LayerGraphs(2, replay=EagerReplay)
    layer_graphs.use_graphs(graphed.model, graphs)
    return plain, graphed, graphs


def _forward(net, batch, labels=False):
    """Logits, and the plan the forward built."""
    ids, packed = batch
    plans = []
    with shared_prefix.observe_plans(lambda plan, tokens: plans.append(plan)):
        out = net(input_ids=ids, labels=ids if labels else None, **packed)
    return out, plans[0]


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_scoring_forwards_replay_or_run_eagerly_as_set_with_the_logits_of_the_model_without_graphs(mode):
    plain, graphed, graphs = _models(**({} if mode == "graphs" else {"shared_prefix_cuda_graphs_scoring": mode}))
    for seed in (1, 2):
        with torch.no_grad():
            want, _ = _forward(plain, _batch(seed))
            got, plan = _forward(graphed, _batch(seed))
        assert (plan.bucket is None) == (mode == "eager")  # padded only for a replay
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-10)
    counts = (graphs.stats.eager, graphs.stats.captures, graphs.stats.replays)
    assert counts == ((2, 0, 0) if mode == "eager" else (0, 1, 1))


def test_eager_scoring_holds_with_buckets_off_too():
    plain, graphed, graphs = _models(shared_prefix_cuda_graphs_scoring="eager", shared_prefix_cuda_graphs_buckets=False)
    for seed, groups in ((1, GROUP), (2, [(66, [4, 8])])):  # two layouts: keyed on the exact layout, each would capture
        ids, cu, _ = tiny.grpo_batch(groups, seed=seed)
        with torch.no_grad():
            want, _ = _forward(plain, (ids, tiny.packed_kwargs(cu)))
            got, _ = _forward(graphed, (ids, tiny.packed_kwargs(cu)))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-10)
    assert (graphs.stats.eager, graphs.stats.captures) == (2, 0)


def test_eager_scoring_leaves_training_steps_to_the_graphs():
    _, graphed, graphs = _models(shared_prefix_cuda_graphs_scoring="eager")
    out, plan = _forward(graphed, _batch(1), labels=True)
    out.loss.backward()
    assert plan.bucket is not None and (graphs.stats.eager, graphs.stats.captures) == (0, 1)


def test_inference_mode_scoring_runs_eagerly_too():
    plain, graphed, graphs = _models(shared_prefix_cuda_graphs_scoring="eager")
    with torch.inference_mode():
        got, plan = _forward(graphed, _batch(1))
        want, _ = _forward(plain, _batch(1))
    assert plan.bucket is None and graphs.stats.eager == 1 and graphs.stats.captures == 0
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-10)


def test_a_wrong_mode_names_the_field_and_the_modes():
    for name in ("shared_prefix_cuda_graphs_scoring", "shared_prefix_cuda_graphs_training"):
        with pytest.raises(SettingError, match=f"{name} must be one of 'graphs', 'eager', 'auto'"):
            tiny.build("qwen3_5", "gpu", shared_prefix_training=True, **{name: "sometimes"})


def test_the_graphs_fields_set_on_a_vision_language_models_composite_config_are_read():
    """`model.config` of ForConditionalGeneration is the composite config: the graphs' fields set there after the
    build reach the text model's layer stack, as the plan's fields do (and differing values in both places are
    refused)."""
    net = tiny.build_conditional("qwen3_5", "gpu", shared_prefix_training=True)
    net.config.shared_prefix_cuda_graphs = True  # on the composite, after the build
    net.config.shared_prefix_cuda_graphs_scoring = "eager"
    graphs = layer_graphs.LayerGraphs(2, replay=EagerReplay)
    layer_graphs.use_graphs(net.model.language_model, graphs)
    ids, packed = _batch(1)
    with torch.no_grad():
        net(input_ids=ids, **packed)
    assert (graphs.stats.eager, graphs.stats.captures) == (1, 0)
    net.config.text_config.shared_prefix_cuda_graphs_scoring = "graphs"  # refused where the plan reads it, first
    refused = pytest.raises(SettingError, match="shared_prefix_cuda_graphs_scoring is 'eager' on the composite config")
    with refused, torch.no_grad():
        net(input_ids=ids, **packed)
