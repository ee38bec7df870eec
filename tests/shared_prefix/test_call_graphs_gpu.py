"""A scoring forward's GDN rounds replayed from one CUDA graph per forward (`call_graphs.py`), on the GPU at
Qwen3.5-4B widths, bf16: every layer's output is the eager rounds' bit for bit, the first layer of a forward runs
eagerly and the second captures, a new plan captures anew, and training forwards never replay. Skipped without CUDA."""

import pytest
import torch
from patchgen.kernels.shared_prefix import (
    build_plan,
    shared_prefix_causal_conv1d,
    shared_prefix_gated_delta_rule,
)
from patchgen.kernels.shared_prefix.call_graphs import CALL_GRAPHS

from tests.models.prefix_trees import pack
from tests.shared_prefix.test_conv_state_gpu import _backends as _conv_backends
from tests.shared_prefix.test_gdn_rounds_gpu import _backends, _gdn_inputs
from tests.shared_prefix.test_tree import agentic, tokens

pytestmark = pytest.mark.gpu

LAYERS = 4


def _plans():
    two_rounds = [tokens(1000, 0) + tokens(96 + i, 1 + i) for i in range(4)]  # unaligned prompt: tails replayed
    three_rounds = agentic(prompt=1000, turns=(130,), last=96, fan=3)
    return [build_plan(*(x.cuda() for x in pack(seqs)), max_depth=4, level_cost=0) for seqs in (two_rounds, three_rounds)]


def _layers(plan, gdn, enabled: bool, mode) -> list[torch.Tensor]:
    """`LAYERS` GDN layers of one scoring forward: the same plan, other inputs each."""
    CALL_GRAPHS.enabled = enabled
    layers = []
    for layer in range(LAYERS):
        q, k, v, g, beta = (x.detach() for x in _gdn_inputs(plan.compact_length))
        layers.append([q * (1 + layer / 8), k, v.flip(1), g, beta])  # other values per layer, same ranges
    with mode():
        return [shared_prefix_gated_delta_rule(plan, gdn, *inputs, use_qk_l2norm_in_kernel=True) for inputs in layers]


def fresh(graphs):
    """`graphs` with nothing held, its counters at zero and no pass lengths learnt for a test, its switch as it was
    after."""
    before = graphs.enabled
    graphs.release()
    graphs._per_pass.clear()
    graphs.captures = graphs.replays = graphs.not_warm = 0
    yield graphs
    graphs.release()
    graphs.enabled = before


@pytest.fixture
def call_graphs():
    yield from fresh(CALL_GRAPHS)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("gdn", _backends())
def test_every_layer_of_a_scoring_forward_replays_the_eager_rounds_bit_for_bit(gdn, mode, call_graphs):
    for n, plan in enumerate(_plans(), start=1):
        eager = _layers(plan, gdn, False, mode)
        replayed = _layers(plan, gdn, True, mode)
        for a, b in zip(eager, replayed):
            assert torch.equal(a, b)
        # the first layer eager, the second captured (and replayed), the rest replayed; a new plan captures anew, at
        # its first layer unless that meets a kernel not loaded yet (its shapes' own specialisation), then at its second
        assert call_graphs.not_warm <= n - 1
        assert (call_graphs.captures, call_graphs.replays) == (n, n * LAYERS - 1 - call_graphs.not_warm)
    again = _layers(plan, gdn, True, mode)  # the same plan in the next forward: replays from its first layer
    assert (call_graphs.captures, call_graphs.replays) == (2, 3 * LAYERS - 1 - call_graphs.not_warm)
    assert all(torch.equal(a, b) for a, b in zip(again, eager))


@pytest.mark.parametrize("gdn", _backends())
def test_a_forward_that_builds_a_graph_for_backward_never_replays(gdn, call_graphs):
    plan = _plans()[0]
    call_graphs.enabled = True
    for _ in range(LAYERS):
        inputs = _gdn_inputs(plan.compact_length)  # inputs that want gradients, grad mode on
        out = shared_prefix_gated_delta_rule(plan, gdn, *inputs, use_qk_l2norm_in_kernel=True)
        assert out.grad_fn is not None
    assert (call_graphs.captures, call_graphs.replays) == (0, 0)


@pytest.mark.parametrize("conv", [p.values[0] for p in _conv_backends()], ids=[p.id for p in _conv_backends()])
def test_every_layer_of_a_scoring_forward_replays_the_eager_conv_bit_for_bit(conv, call_graphs):
    plan = _plans()[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [
        (torch.randn(1, plan.compact_length, 8192, device="cuda", dtype=torch.bfloat16, generator=gen),
         torch.randn(8192, 4, device="cuda", dtype=torch.bfloat16, generator=gen) / 2)
        for _ in range(LAYERS)
    ]

    def forward(enabled):
        CALL_GRAPHS.enabled = enabled
        with torch.no_grad():
            return [shared_prefix_causal_conv1d(plan, conv, x, w, activation="silu") for x, w in layers]

    eager = forward(False)
    replayed = forward(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed))
    assert (call_graphs.captures, call_graphs.replays) == (1, LAYERS - 1)


@pytest.mark.parametrize("gdn", _backends())
def test_graphs_captured_for_new_plans_reuse_the_memory_of_those_they_replace(gdn, call_graphs):
    """Every micro-batch brings a new plan, so a graph is captured per forward. A graph with a pool of its own would
    leave that pool reserved when it goes (torch frees it on empty_cache or a failed allocation only): the graphs
    share one pool, and the reserved memory stays flat forward after forward."""
    seqs = [tokens(1000, 0) + tokens(96 + i, 1 + i) for i in range(4)]
    ids, cu = (x.cuda() for x in pack(seqs))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = []
    for _ in range(6):
        plan = build_plan(ids, cu, max_depth=4, level_cost=0)  # equal to the last, but another plan: captured anew
        _layers(plan, gdn, True, torch.no_grad)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert call_graphs.captures == 6
    assert reserved[-1] - reserved[2] < 16 * 2**20, [r / 2**20 for r in reserved]


@pytest.mark.parametrize("gdn", _backends())
def test_a_replay_on_another_stream_waits_for_the_last(gdn, call_graphs):
    """Two streams taking turns (each a thread's or a caller's own): the outputs stay the eager ones."""
    plan = _plans()[0]
    eager = _layers(plan, gdn, False, torch.no_grad)
    CALL_GRAPHS.enabled = True
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = []
    for layer in range(LAYERS):
        q, k, v, g, beta = (x.detach() for x in _gdn_inputs(plan.compact_length))
        inputs.append([q * (1 + layer / 8), k, v.flip(1), g, beta])
    outs = []
    with torch.no_grad():
        for layer, xs in enumerate(inputs):
            stream = streams[layer % 2]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                outs.append(shared_prefix_gated_delta_rule(plan, gdn, *xs, use_qk_l2norm_in_kernel=True))
            torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert call_graphs.replays == LAYERS - 1
    assert all(torch.equal(a, b) for a, b in zip(outs, eager))
