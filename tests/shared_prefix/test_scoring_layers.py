"""A shared-prefix scoring forward's decoder layers replayed from one graph per kind (`modeling/scoring_layers.py`),
on the CPU: a stand-in "captures" by keeping the layer call on the static copies of its weights and inputs, so a
replay that read another layer's weights, a stale input or a stale keyword would change the log-probs. Which
forwards the graphs serve, and the order of eager layers, captures and replays. The real graphs' bit-equality is
checked on the GPU (test_call_graphs_gpu.py)."""

import pytest
import torch
from patchgen.kernels.errors import SettingError
from patchgen.kernels.modeling import scoring_layers
from patchgen.kernels.shared_prefix import call_graphs as call_graphs_module
from patchgen.kernels.shared_prefix.call_graphs import LAYERS_ON_BY_DEFAULT, enabled_in

from tests.models import tiny
from tests.shared_prefix.test_call_graphs import _StandIn

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention",
               "full_attention"]


class _LayerStandIn(_StandIn):
    on_device = staticmethod(lambda x: True)


@pytest.fixture
def layer_graphs(monkeypatch):
    stand_in = _LayerStandIn()
    monkeypatch.setattr(call_graphs_module, "LAYER_GRAPHS", stand_in)
    return stand_in


def _model(**extra):
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, num_hidden_layers=6, layer_types=LAYER_TYPES,
                     **extra)
    return net.eval()


def _batch():
    return tiny.grpo_batch([(70, [9, 14, 5]), (66, [12, 3])], singles=[11])


def _log_probs(net, ids, cu, **extra):
    return net(input_ids=ids, return_log_probs=True, return_logits=False, **tiny.packed_kwargs(cu), **extra).log_probs


def _eager(net, ids, cu, **extra):
    with call_graphs_module.LAYER_GRAPHS.held_off():
        return _log_probs(net, ids, cu, **extra)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_scoring_forwards_layers_replay_per_kind_and_equal_the_eager_forward(mode, layer_graphs):
    net, (ids, cu, _) = _model(), _batch()
    with mode():
        eager = _eager(net, ids, cu)
        assert layer_graphs.captures == layer_graphs.replays == 0
        assert torch.equal(_log_probs(net, ids, cu), eager)
        # four GDN layers: eager, captured and replayed, replayed, replayed; two attention layers: eager, captured
        assert (layer_graphs.captures, layer_graphs.replays) == (2, 4)
        assert len(layer_graphs.entries) == 2
        # the next micro-batch (another plan): captured anew, each replay on its own weights and inputs again
        other_ids, other_cu, _ = tiny.grpo_batch([(60, [8, 13]), (72, [4, 9, 6])], seed=1)
        expected = _eager(net, other_ids, other_cu)
        assert torch.equal(_log_probs(net, other_ids, other_cu), expected)
        assert (layer_graphs.captures, layer_graphs.replays) == (4, 8)


def test_a_replayed_layer_reads_its_own_weights(layer_graphs):
    """Layers of one kind with equal weights would hide a replay that kept the captured layer's: make them differ."""
    net, (ids, cu, _) = _model(), _batch()
    with torch.no_grad():
        for layer in net.model.layers[3:]:
            for p in layer.parameters():
                p.mul_(1.5)
        eager = _eager(net, ids, cu)
        assert torch.equal(_log_probs(net, ids, cu), eager)
        assert layer_graphs.replays == 4


def test_no_layer_replays_where_a_graph_would_skip_work_or_is_not_wanted(layer_graphs, monkeypatch):
    net, (ids, cu, _) = _model(), _batch()
    _log_probs(net, ids, cu).sum().backward()  # training: autograd needs every layer's node
    assert layer_graphs.captures == layer_graphs.replays == 0
    with torch.no_grad():
        # per-layer outputs are recorded by hooks, which run when a layer is called
        out = net(input_ids=ids, output_hidden_states=True, **tiny.packed_kwargs(cu))
        assert len(out.hidden_states) == 7 and layer_graphs.captures == 0
        monkeypatch.setattr(scoring_layers, "MAX_LAYER_BYTES", 0)  # every layer's weights too large to copy
        before = (layer_graphs.captures, layer_graphs.replays)
        _log_probs(net, ids, cu)
        assert (layer_graphs.captures, layer_graphs.replays) == before


def _replayed_layers(graphs, net, ids, cu) -> set[int]:
    """Indices of the layers a forward replayed (the forward runs with a hook on none)."""
    replayed, run = set(), graphs.run

    def tracking(kind, index, settings, body, inputs):
        out = run(kind, index, settings, body, inputs)
        if out is not None:
            weight = inputs[-1]
            replayed.update(i for i, layer in enumerate(net.model.layers) if any(p is weight for p in layer.buffers())
                            or any(p is weight for p in layer.parameters()))
        return out

    graphs.run = tracking
    try:
        _log_probs(net, ids, cu)
    finally:
        del graphs.run
    return replayed


def test_a_hooked_layer_runs_as_it_is_and_the_others_still_replay(layer_graphs):
    net, (ids, cu, _) = _model(), _batch()
    with torch.no_grad():
        assert _replayed_layers(layer_graphs, net, ids, cu) == {1, 3, 4, 5}
        calls = []
        handle = net.model.layers[4].register_forward_pre_hook(lambda *args: calls.append(1))
        replayed = _replayed_layers(layer_graphs, net, ids, cu)
        handle.remove()
        assert calls == [1] and 4 not in replayed and {1, 3, 5} <= replayed


def test_the_environment_turns_the_layer_graphs_on_or_off_and_a_wrong_value_is_an_error():
    assert enabled_in({"PATCHGEN_LAYER_GRAPHS": "1"}, name="PATCHGEN_LAYER_GRAPHS")
    assert not enabled_in({"PATCHGEN_LAYER_GRAPHS": "0", "PATCHGEN_CALL_GRAPHS": "1"}, name="PATCHGEN_LAYER_GRAPHS")
    assert enabled_in({}, name="PATCHGEN_LAYER_GRAPHS", default=LAYERS_ON_BY_DEFAULT) is LAYERS_ON_BY_DEFAULT
    with pytest.raises(SettingError, match="PATCHGEN_LAYER_GRAPHS='on'"):
        enabled_in({"PATCHGEN_LAYER_GRAPHS": "on"}, name="PATCHGEN_LAYER_GRAPHS")


def test_a_training_forward_releases_the_scoring_graphs_before_its_backward(layer_graphs):
    net, (ids, cu, _) = _model(), _batch()
    with torch.no_grad():
        _log_probs(net, ids, cu)
    assert layer_graphs.entries  # held for the next scoring forward on this plan
    loss = _log_probs(net, ids, cu).sum()
    assert not layer_graphs.entries and not layer_graphs._seen  # the weight copies and working memory are gone
    loss.backward()
