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
from patchgen.kernels.shared_prefix.gdn_rounds import ReferenceRounds
from torch.fx.experimental.proxy_tensor import make_fx

from tests.models import lora_like, tiny
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
        # the next micro-batch (another plan): captured anew at the first GDN layer (a pass of the kind has run),
        # each replay on its own weights and inputs again; but only where a capture pays for itself: two attention
        # layers are too few, and run eagerly
        other_ids, other_cu, _ = tiny.grpo_batch([(60, [8, 13]), (72, [4, 9, 6])], seed=1)
        expected = _eager(net, other_ids, other_cu)
        assert torch.equal(_log_probs(net, other_ids, other_cu), expected)
        assert (layer_graphs.captures, layer_graphs.replays) == (3, 8)
        assert len(layer_graphs.entries) == 1  # the first plan's attention graph is dropped, with its memory


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

    def tracking(kind, index, settings, body, inputs, live=()):
        out = run(kind, index, settings, body, inputs, live)
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


class _TracedGraph:
    def __init__(self, traced, entry):
        self.traced, self.entry = traced, entry

    def replay(self, *live):
        # a CUDA graph runs the kernels it captured whatever autocast says at replay
        with torch.autocast("cpu", enabled=False):
            self.entry.out = self.traced(*self.entry.statics, *live)


class _TracedLayerStandIn(_LayerStandIn):
    """A capture traced into aten ops (`make_fx`), as a CUDA graph captures kernels: the host branches the call took
    (an adapter on or off, autocast's casts) and its Python floats are baked in, and a replay runs only those ops."""

    def _capture(self, key, index, body, inputs, live=()):
        statics = [x.clone() for x in inputs]
        entry = call_graphs_module._Entry(key, index, statics, None, torch.empty(0))
        entry.graph = _TracedGraph(make_fx(body)(*statics, *live), entry)
        self.captures += 1
        return entry


@pytest.fixture
def traced_layer_graphs(monkeypatch):
    stand_in = _TracedLayerStandIn()
    monkeypatch.setattr(call_graphs_module, "LAYER_GRAPHS", stand_in)
    return stand_in


def _with_adapters(net):
    return [lora_like.wrap(layer.mlp, "down_proj", seed=i) for i, layer in enumerate(net.model.layers)]


def test_an_adapter_switched_off_on_a_kept_plan_is_not_replayed_on(traced_layer_graphs):
    """TRL scores the reference model as the policy under PEFT's `disable_adapter()`, on the plan the policy's
    log-probs kept (`shared_prefix_plan_reuse`): a replay of the graphs captured with the adapters on would hand back
    the policy's log-probs as the reference's."""
    net, (ids, cu, _) = _model(), _batch()
    adapters = _with_adapters(net)
    with torch.no_grad():
        policy = _log_probs(net, ids, cu)
        assert traced_layer_graphs.replays == 4
        for adapter in adapters:
            adapter._disable_adapters = True
        reference = _eager(net, ids, cu)
        assert not torch.equal(reference, policy)
        assert torch.equal(_log_probs(net, ids, cu), reference)


def test_layers_of_one_kind_with_their_own_adapter_scales_replay_their_own(traced_layer_graphs):
    """PEFT's per-layer scales (`alpha_pattern`) are host floats of each layer's adapter, not weights a replay
    copies."""
    net, (ids, cu, _) = _model(), _batch()
    for adapter, scale in zip(_with_adapters(net), (0.5, 0.5, 0.5, 2.0, 0.5, 0.5)):
        adapter.scaling = {"default": scale}
    with torch.no_grad():
        expected = _eager(net, ids, cu)
        assert torch.equal(_log_probs(net, ids, cu), expected)


class _AutocastOfCaptureStandIn(_LayerStandIn):
    """A replay runs under the autocast state of its capture, as a CUDA graph replays the casts it captured (the traced
    stand-in cannot trace the float32 path's Triton kernels, run by the interpreter on the CPU)."""

    def _capture(self, key, index, body, inputs, live=()):
        entry = super()._capture(key, index, body, inputs, live)
        enabled, dtype, run = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), entry.graph.body

        def as_captured(*live):
            with torch.autocast("cpu", dtype=dtype, enabled=enabled):
                run(*live)

        entry.graph.body = as_captured
        return entry


def test_a_forward_under_autocast_on_a_kept_plan_is_not_replayed_from_one_without(monkeypatch):
    """Mixed precision (accelerate's autocast around the model's forward) on some scoring forwards of a batch only."""
    stand_in = _AutocastOfCaptureStandIn()
    monkeypatch.setattr(call_graphs_module, "LAYER_GRAPHS", stand_in)
    net, (ids, cu, _) = _model().float(), _batch()
    with torch.no_grad():
        _log_probs(net, ids, cu)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = _eager(net, ids, cu)
            assert torch.equal(_log_probs(net, ids, cu), expected)
        assert stand_in.replays >= 4


def test_a_training_forward_through_frozen_layers_gives_a_partly_trained_layer_its_gradients(layer_graphs):
    """Frozen bottom layers hand a later layer hidden states that want no gradient; that layer's first parameter is
    frozen too, its MLP trains: replayed, it would lose its node (the copy into the statics even raises)."""
    net, (ids, cu, _) = _model(), _batch()
    net.requires_grad_(False)
    for layer in net.model.layers[3:]:
        layer.mlp.requires_grad_(True)
    _eager(net, ids, cu).sum().backward()
    expected = tiny.grads(net)
    net.zero_grad(set_to_none=True)
    _log_probs(net, ids, cu).sum().backward()
    got = tiny.grads(net)
    assert got.keys() == expected.keys() and len(got) == 9
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_a_training_forward_that_shares_nothing_releases_the_scoring_graphs_too(layer_graphs):
    """A micro-batch whose rows share no prefix trains without a plan; its backward needs the memory as much."""
    net, (ids, cu, _) = _model(), _batch()
    with torch.no_grad():
        _log_probs(net, ids, cu)
    assert layer_graphs.entries
    unshared_ids, unshared_cu, _ = tiny.grpo_batch([], singles=[21, 17])
    loss = _log_probs(net, unshared_ids, unshared_cu).sum()
    assert not layer_graphs.entries
    loss.backward()


class _ScaledLinear(torch.nn.Module):
    """A quantised projection in the manner of HQQ's: the weight a parameter, its scales a plain attribute (a dict of
    tensors) that the forward reads and that no replay copies."""

    def __init__(self, base: torch.nn.Linear, scale: float):
        super().__init__()
        self.weight = torch.nn.Parameter(base.weight.detach().clone())
        self.meta = {"scale": torch.full((base.out_features, 1), scale, dtype=base.weight.dtype)}

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * self.meta["scale"])


def test_a_layer_reading_tensors_held_outside_its_parameters_and_buffers_runs_as_it_is(traced_layer_graphs):
    net, (ids, cu, _) = _model(), _batch()
    for i, layer in enumerate(net.model.layers):
        layer.mlp.down_proj = _ScaledLinear(layer.mlp.down_proj, 0.5 + 0.25 * i)
    with torch.no_grad():
        expected = _eager(net, ids, cu)
        assert torch.equal(_log_probs(net, ids, cu), expected)


def test_a_reference_model_on_the_policys_kept_plan_replays_from_its_first_layer_on_its_own_weights(
    traced_layer_graphs,
):
    """The plan comes back for the same batch (`shared_prefix_plan_reuse`), so the graphs the policy's forward left
    match from the reference's first layer on (its own op table binds the same backends): every layer replays,
    reading the reference's weights and hidden states."""
    policy, (ids, cu, _) = _model(), _batch()
    reference = tiny.build("qwen3_5", "gpu", seed=3, shared_prefix_training=True, num_hidden_layers=6,
                           layer_types=LAYER_TYPES).eval()
    with torch.no_grad():
        _log_probs(policy, ids, cu)
        expected = _eager(reference, ids, cu)
        replays = traced_layer_graphs.replays
        assert torch.equal(_log_probs(reference, ids, cu), expected)
        assert traced_layer_graphs.replays - replays == 6


class _TablesOfItsOwn(ReferenceRounds):
    """GDN stages that derive and cache their chunk tables (fla's per-round path, PATCHGEN_FLA_JOINT_ROUNDS=0)."""

    plan_tables = False


def test_a_layer_whose_gdn_backend_keeps_tables_of_its_own_is_not_captured(traced_layer_graphs, monkeypatch):
    """A graph would keep reading the tables the backend cached at capture (by tensor identity), after its cache
    freed them: the capture is refused, with the fix named, and the layers stay eager."""
    net, (ids, cu, _) = _model(), _batch()
    monkeypatch.setattr("patchgen.kernels.shared_prefix.gdn.round_kernels", lambda fn, dtype: _TablesOfItsOwn(fn))
    with torch.no_grad():
        eager = _eager(net, ids, cu)
        with pytest.warns(call_graphs_module.CallGraphUnavailable, match="PATCHGEN_FLA_JOINT_ROUNDS=0.*"
                          "PATCHGEN_LAYER_GRAPHS=0"):
            scored = _log_probs(net, ids, cu)
    assert torch.equal(scored, eager)
    assert not traced_layer_graphs.enabled and traced_layer_graphs.replays == 0


def test_a_layer_whose_conv_backend_has_no_plan_table_kernels_is_not_captured(traced_layer_graphs, monkeypatch):
    """A conv backend without look-back kernels runs on the plan's cu_seqlens through its own entry point (fla's
    caches the chunk indices it derives): refused in a layer graph, the fix named."""
    net, (ids, cu, _) = _model(), _batch()
    monkeypatch.setattr("patchgen.kernels.shared_prefix.conv.look_back_kernels", lambda fn, dtype: None)
    with torch.no_grad():
        eager = _eager(net, ids, cu)
        with pytest.warns(call_graphs_module.CallGraphUnavailable, match="causal_conv1d backend.*PATCHGEN_LAYER_GRAPHS=0"):
            scored = _log_probs(net, ids, cu)
    assert torch.equal(scored, eager)
    assert not traced_layer_graphs.enabled


def test_a_layer_wrapped_by_torch_distributed_runs_as_it_is():
    """FSDP1's wrapper gathers its shards inside its own forward, not through hooks the hook walk would see."""
    wrapper = type("FullyShardedDataParallel", (torch.nn.Module,), {"__module__": "torch.distributed.fsdp.api"})()
    wrapper.inner = torch.nn.Linear(2, 2)
    assert scoring_layers._walk(wrapper) is None
    assert scoring_layers._walk(wrapper.inner) is not None


def test_a_training_forward_is_told_apart_before_the_layer_walks(layer_graphs, monkeypatch):
    """An eager training step is host-bound: its layers must not pay the hook and attribute walks a replay needs."""
    walks = []
    monkeypatch.setattr(scoring_layers, "_split_kwargs", lambda kwargs: walks.append(1))
    monkeypatch.setattr(scoring_layers, "_walk", lambda layer: walks.append(1))
    net, (ids, cu, _) = _model(), _batch()
    _log_probs(net, ids, cu).sum().backward()
    assert walks == [] and layer_graphs.captures == 0


def test_a_tensor_attached_after_the_first_walk_is_still_seen():
    """Whether a module holds tensors beside its tables is kept between calls: one attached later (a quantiser's
    scales) must still make the layer run as it is."""
    layer = _model().model.layers[3]
    assert scoring_layers._walk(layer) is not None  # found and kept
    layer.mlp.down_proj.scales = torch.ones(3)
    assert scoring_layers._walk(layer) is None
