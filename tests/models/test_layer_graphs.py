"""`shared_prefix_cuda_graphs` on the CPU: the graphed step's machinery (key, static buffers, loads, cache,
autograd node) run with `EagerReplay`, which replays the static buffers eagerly where a CUDA graph
would replay its kernels. Float64: the graphed step must equal the ordinary shared-prefix step bit
for bit (same ops on the same rows), over captures, replays and accumulated micro-batches; and every
refusal names its reason. These tests key the graphs on the exact layout (buckets off: the plan is not
padded, so the rows are the eager step's); padded plans are `test_layer_graph_buckets.py`'s."""

import pytest
import torch
from patchgen.kernels.errors import CudaGraphsUnavailable, GraphReplayOverwritten, SettingError
from patchgen.kernels.graphs import EagerReplay
from patchgen.kernels.modeling import layer_graphs

from tests.models import lora_like, tiny

A = [(70, [5, 9, 3])]  # one GRPO group of three
C = [(70, [5, 9, 4])]  # one response one token longer: another layout


def _batch(groups, seed):
    ids, cu, prompt = tiny.grpo_batch(groups, seed=seed)
    return ids, ids.masked_fill(prompt, -100), tiny.packed_kwargs(cu)


def _model(model="qwen3_5", graphs=True, cache=2, **extra):
    extra.setdefault("shared_prefix_cuda_graphs_buckets", False)
    net = tiny.build(model, "gpu", shared_prefix_training=True, shared_prefix_cuda_graphs=graphs,
                     shared_prefix_cuda_graphs_cache=cache, **extra)
    if graphs:
        layer_graphs.use_graphs(net.model, layer_graphs.LayerGraphs(cache, replay=EagerReplay))
    return net


def _step(net, batches, **kwargs):
    """Zeroed gradients, then each micro-batch's loss x (1 + its index) backward: (losses, gradients)."""
    net.zero_grad(set_to_none=True)
    losses = []
    for i, (ids, labels, packed) in enumerate(batches):
        out = net(input_ids=ids, labels=labels, **packed, **kwargs)
        (out.loss * (1 + i)).backward()
        losses.append(out.loss.detach())
    return losses, tiny.grads(net)


def _same(eager, graphed):
    assert [l.item() for l in graphed[0]] == [l.item() for l in eager[0]]
    assert graphed[1].keys() == eager[1].keys()
    assert tiny.max_diff(graphed[1], eager[1]) == 0.0


def test_graphed_step_equals_the_shared_step_through_capture_replay_and_new_capture():
    eager, graphed = _model(graphs=False), _model()
    stats = layer_graphs.graphs_of(graphed).stats
    _same(_step(eager, [_batch(A, 1)]), _step(graphed, [_batch(A, 1)]))
    assert (stats.captures, stats.replays) == (1, 0)
    # A's layout with other tokens, two accumulated micro-batches: both replay, the second adds onto the first
    batches = [_batch(A, 2), _batch(A, 3)]
    _same(_step(eager, batches), _step(graphed, batches))
    assert (stats.captures, stats.replays) == (1, 2)
    _same(_step(eager, [_batch(C, 4)]), _step(graphed, [_batch(C, 4)]))
    assert (stats.captures, stats.replays, stats.evictions) == (2, 2, 0)


def test_parameter_gradients_never_alias_the_static_buffers():
    graphed = _model()
    _step(graphed, [_batch(A, 1)])
    entry = next(iter(layer_graphs.graphs_of(graphed).cache._entries.values()))
    buffers = {b.data_ptr() for b in entry.replay._grads if b is not None}
    assert not buffers & {p.grad.data_ptr() for p in graphed.parameters() if p.grad is not None}


def test_the_least_recently_used_graph_is_evicted():
    graphed = _model(cache=1)
    graphs = layer_graphs.graphs_of(graphed)
    _step(graphed, [_batch(A, 1)])
    _step(graphed, [_batch(C, 2)])
    _step(graphed, [_batch(A, 3)])
    assert (graphs.stats.captures, graphs.stats.replays, graphs.stats.evictions, len(graphs.cache)) == (3, 0, 2, 1)


def test_a_backward_after_a_later_forward_of_the_same_graph_raises():
    graphed = _model()
    ids, labels, packed = _batch(A, 1)
    first = graphed(input_ids=ids, labels=labels, **packed).loss
    second = graphed(input_ids=ids, labels=labels, **packed).loss
    with pytest.raises(GraphReplayOverwritten, match="overwrote the activations"):
        first.backward()
    second.backward()


def test_forwards_without_a_plan_run_the_layers_as_they_are():
    graphed = _model()
    unshared, cu_unshared = tiny.packed_batch([30, 40], seed=2)  # nothing shared: no plan
    graphed(input_ids=unshared, labels=unshared, **tiny.packed_kwargs(cu_unshared)).loss.backward()
    with torch.no_grad():
        graphed(input_ids=unshared, **tiny.packed_kwargs(cu_unshared))
    assert layer_graphs.graphs_of(graphed) is None or layer_graphs.graphs_of(graphed).stats.calls == 0


def _score(net, batch, **kwargs):
    ids, _, packed = batch
    with torch.no_grad():
        return net(input_ids=ids, **packed, **kwargs).logits


def test_a_scoring_forward_replays_a_graph_of_its_own_and_equals_the_eager_forward():
    eager, graphed = _model(graphs=False), _model()
    stats = layer_graphs.graphs_of(graphed).stats
    first = _score(graphed, _batch(A, 1))
    assert torch.equal(first, _score(eager, _batch(A, 1)))
    kept = first.clone()
    # A's layout with other tokens: the capture replays, and the first call's logits are not overwritten
    assert torch.equal(_score(graphed, _batch(A, 2)), _score(eager, _batch(A, 2)))
    assert (stats.captures, stats.replays) == (1, 1)
    assert torch.equal(first, kept)


def test_training_steps_and_scoring_forwards_of_one_layout_keep_separate_graphs():
    eager, graphed = _model(graphs=False), _model()
    stats = layer_graphs.graphs_of(graphed).stats
    assert torch.equal(_score(graphed, _batch(A, 1)), _score(eager, _batch(A, 1)))  # the old policy's log-probs
    _same(_step(eager, [_batch(A, 1)]), _step(graphed, [_batch(A, 1)]))  # then the step on them
    assert (stats.captures, stats.replays) == (2, 0)
    assert torch.equal(_score(graphed, _batch(A, 3)), _score(eager, _batch(A, 3)))
    _same(_step(eager, [_batch(A, 4)]), _step(graphed, [_batch(A, 4)]))
    assert (stats.captures, stats.replays) == (2, 2)


def test_scoring_in_inference_mode_keeps_a_graph_apart_from_no_grad_scoring():
    eager, graphed = _model(graphs=False), _model()
    with torch.inference_mode():
        ids, _, packed = _batch(A, 1)
        assert torch.equal(graphed(input_ids=ids, **packed).logits, eager(input_ids=ids, **packed).logits)
    # buffers made in inference mode cannot be written outside it: no_grad scoring must capture its own
    assert torch.equal(_score(graphed, _batch(A, 2)), _score(eager, _batch(A, 2)))
    assert layer_graphs.graphs_of(graphed).stats.captures == 2


def test_a_frozen_reference_model_scores_through_the_scoring_graph_with_gradients_enabled():
    eager, graphed = _model(graphs=False), _model()
    for net in (eager, graphed):
        net.requires_grad_(False)
    ids, _, packed = _batch(A, 1)
    assert torch.equal(graphed(input_ids=ids, **packed).logits, eager(input_ids=ids, **packed).logits)
    assert layer_graphs.graphs_of(graphed).stats.captures == 1


def test_a_scoring_forward_that_asks_for_hidden_states_runs_eagerly():
    eager, graphed = _model(graphs=False), _model()
    got = _score_hidden(graphed)
    want = _score_hidden(eager)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    assert layer_graphs.graphs_of(graphed).stats.calls == 0


def _score_hidden(net):
    ids, _, packed = _batch(A, 1)
    with torch.no_grad():
        return net(input_ids=ids, **packed, output_hidden_states=True).hidden_states


def test_moe_scoring_forward_equals_the_eager_forward():
    eager, graphed = _model("qwen3_5_moe", graphs=False), _model("qwen3_5_moe")
    for seed in (1, 2):
        no_router = {"output_router_logits": False}  # the tiny MoE config asks for them (training's aux loss)
        assert torch.equal(_score(graphed, _batch(A, seed), **no_router), _score(eager, _batch(A, seed), **no_router))
    assert layer_graphs.graphs_of(graphed).stats.replays == 1
    # with router logits asked for (the config's default here), the scoring forward runs eagerly and gives them
    ids, _, packed = _batch(A, 3)
    with torch.no_grad():
        got, want = graphed(input_ids=ids, **packed), eager(input_ids=ids, **packed)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.router_logits[0], want.router_logits[0])
    assert layer_graphs.graphs_of(graphed).stats.calls == 2


def test_the_flag_turned_off_drops_the_graphs():
    graphed = _model()
    _step(graphed, [_batch(A, 1)])
    graphed.config.shared_prefix_cuda_graphs = False
    _step(graphed, [_batch(A, 2)])
    assert layer_graphs.graphs_of(graphed) is None


def test_moe_graphed_step_equals_the_shared_step():
    kwargs = {"output_router_logits": False}
    eager, graphed = _model("qwen3_5_moe", graphs=False), _model("qwen3_5_moe")
    _same(_step(eager, [_batch(A, 1)], **kwargs), _step(graphed, [_batch(A, 1)], **kwargs))
    assert layer_graphs.graphs_of(graphed).stats.captures == 1


def test_router_logits_asked_for_are_refused():
    graphed = _model("qwen3_5_moe")
    with pytest.raises(CudaGraphsUnavailable, match="output_router_logits"):
        _step(graphed, [_batch(A, 1)], output_router_logits=True)


def test_hidden_states_asked_for_are_refused():
    graphed = _model()
    with pytest.raises(CudaGraphsUnavailable, match="output_hidden_states"):
        _step(graphed, [_batch(A, 1)], output_hidden_states=True)


def test_activation_checkpointing_is_refused():
    graphed = _model()
    (getattr(graphed, "activation_checkpointing_enable", None) or graphed.gradient_checkpointing_enable)()
    graphed.train()
    with pytest.raises(CudaGraphsUnavailable, match="activation checkpointing"):
        _step(graphed, [_batch(A, 1)])


def test_cuda_graphs_on_a_cpu_model_are_refused():
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_cuda_graphs=True)
    with pytest.raises(CudaGraphsUnavailable, match="need a CUDA device"):
        _step(net, [_batch(A, 1)])


def test_the_environment_variable_turns_the_graphs_on_and_off(monkeypatch):
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    monkeypatch.setenv("PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS", "1")
    with pytest.raises(CudaGraphsUnavailable, match="need a CUDA device"):
        _step(net, [_batch(A, 1)])
    net.config.shared_prefix_cuda_graphs = True
    monkeypatch.setenv("PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS", "0")
    _step(net, [_batch(A, 1)])  # off: the ordinary step
    monkeypatch.setenv("PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS", "yes")
    with pytest.raises(SettingError, match="PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS"):
        _step(net, [_batch(A, 1)])


@pytest.mark.parametrize("name,value", [("shared_prefix_cuda_graphs", "yes"), ("shared_prefix_cuda_graphs_cache", 0)])
def test_bad_config_values_are_refused_at_build(name, value):
    with pytest.raises(SettingError, match=name):
        tiny.build("qwen3_5", "gpu", **{name: value})


def test_a_hook_on_a_module_of_the_stack_is_refused():
    graphed = _model()
    graphed.model.layers[0].mlp.register_forward_hook(lambda module, args, out: None)  # a probe: its Python would run at capture only
    with pytest.raises(CudaGraphsUnavailable, match=r"have hooks \(layers\.0\.mlp\)"):
        _step(graphed, [_batch(A, 1)])


def test_a_global_module_hook_is_refused():
    graphed = _model()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        with pytest.raises(CudaGraphsUnavailable, match="every module"):
            _step(graphed, [_batch(A, 1)])
    finally:
        handle.remove()


def test_transformers_output_recorders_left_on_the_layers_do_not_refuse_a_step():
    graphed = _model()
    ids, labels, packed = _batch(A, 1)
    with torch.no_grad():  # a scoring pass that asks for hidden states installs transformers' recorders for good
        graphed(input_ids=ids, labels=labels, **packed, output_hidden_states=True)
    assert any(layer._forward_hooks for layer in graphed.model.layers)
    _step(graphed, [_batch(A, 2)])
    assert layer_graphs.graphs_of(graphed).stats.captures == 1


def test_a_tensor_hook_on_a_parameter_of_the_stack_is_refused():
    graphed = _model()
    graphed.model.layers[0].mlp.down_proj.weight.register_hook(lambda g: g * 0.5)  # would fire at capture and again on replay
    with pytest.raises(CudaGraphsUnavailable, match=r"layers\.0\.mlp\.down_proj\.weight \(register_hook\)"):
        _step(graphed, [_batch(A, 1)])


def test_post_accumulate_grad_hooks_fire_once_per_graphed_backward():
    graphed = _model()
    fired = []
    graphed.model.layers[0].mlp.down_proj.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    _step(graphed, [_batch(A, 1)])  # captures
    _step(graphed, [_batch(A, 2), _batch(A, 3)])  # replays twice
    assert len(fired) == 3


def test_a_smaller_cache_bound_set_later_holds_from_the_next_capture():
    graphed = _model(cache=2)
    graphs = layer_graphs.graphs_of(graphed)
    _step(graphed, [_batch(A, 1)])
    _step(graphed, [_batch(C, 2)])
    graphed.config.shared_prefix_cuda_graphs_cache = 1
    _step(graphed, [_batch(A, 3)])  # replays A: the bound is checked when room is made
    _step(graphed, [_batch([(70, [5, 9, 5])], 4)])
    assert len(graphs.cache) == 1


def test_a_new_num_items_in_batch_every_step_replays_and_scales_the_loss_as_eager():
    eager, graphed = _model(graphs=False), _model()
    for i, count in enumerate((50, 61, torch.tensor(37))):  # HF Trainer's token count of the accumulation window
        _same(_step(eager, [_batch(A, i)], num_items_in_batch=count), _step(graphed, [_batch(A, i)], num_items_in_batch=count))
    stats = layer_graphs.graphs_of(graphed).stats
    assert (stats.captures, stats.replays) == (1, 2)


def test_a_flag_set_to_a_string_after_the_build_is_refused():
    net = _model(graphs=False)
    net.config.shared_prefix_cuda_graphs = "false"  # would read as on
    with pytest.raises(SettingError, match="shared_prefix_cuda_graphs must be True or False, got 'false'"):
        _step(net, [_batch(A, 1)])


def test_a_pending_backward_of_an_evicted_graph_returns_its_own_gradients():
    eager, graphed = _model(graphs=False), _model(cache=1)
    results = []
    for net in (eager, graphed):
        net.zero_grad(set_to_none=True)
        first, second = (net(input_ids=i, labels=l, **p).loss for i, l, p in (_batch(A, 1), _batch(C, 2)))
        first.backward()  # A's graph was evicted by C's capture; its forward is still pending
        second.backward()
        results.append(([first.detach(), second.detach()], tiny.grads(net)))
    _same(*results)
    assert layer_graphs.graphs_of(graphed).stats.evictions == 1


def _with_adapter(net):
    lora_like.wrap(net.model.layers[0].mlp, "down_proj")
    return net


def test_an_adapter_switched_off_between_scoring_passes_captures_anew():
    """TRL scores the reference model as the policy under PEFT's `disable_adapter()`: the switch is a host
    flag the forward branches on, so the reference pass must not replay the policy's graph."""
    eager, graphed = _with_adapter(_model(graphs=False)), _with_adapter(_model())
    with_adapter = _score(graphed, _batch(A, 1))
    assert torch.equal(with_adapter, _score(eager, _batch(A, 1)))
    for net in (eager, graphed):
        net.model.layers[0].mlp.down_proj._disable_adapters = True
    without = _score(graphed, _batch(A, 1))
    assert torch.equal(without, _score(eager, _batch(A, 1)))
    assert not torch.equal(with_adapter, without)
    assert layer_graphs.graphs_of(graphed).stats.captures == 2
    for net in (eager, graphed):
        net.model.layers[0].mlp.down_proj.scaling = {"default": 2.0}  # PEFT's set_scale
        net.model.layers[0].mlp.down_proj._disable_adapters = False
    assert torch.equal(_score(graphed, _batch(A, 2)), _score(eager, _batch(A, 2)))
    assert layer_graphs.graphs_of(graphed).stats.captures == 3
