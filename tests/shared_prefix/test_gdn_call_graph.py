"""When a scoring forward's GDN rounds replay from a graph (`gdn_call_graph.py`), on the CPU: which calls the graphs
serve, and the order in which a forward's layers run eagerly, capture and replay (a stand-in runs the captured rounds
eagerly on the static inputs; the real graphs' bit-equality is checked on the GPU, test_gdn_call_graph_gpu.py)."""

import torch
from patchgen.kernels.reference.gated_delta_rule import gated_delta_rule as reference_gdn
from patchgen.kernels.shared_prefix import build_plan
from patchgen.kernels.shared_prefix.gdn_call_graph import GDNCallGraphs, _Entry
from patchgen.kernels.shared_prefix.gdn_rounds import ReferenceRounds, rounds_forward

from tests.models.prefix_trees import pack
from tests.shared_prefix.test_tree import tokens


class _Planned(ReferenceRounds):
    plan_tables = True


class _EagerGraph:
    def __init__(self, body):
        self.body = body

    def replay(self):
        self.body()


class _StandIn(GDNCallGraphs):
    """Captures by keeping the rounds to run on the static inputs; serves CPU tensors."""

    def applies(self, kernels, inputs):
        return self.enabled and not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs))

    def _capture(self, key, kernels, idx, scale, l2norm, inputs):
        statics = [x.clone() for x in inputs]
        out = torch.empty(0)
        entry = _Entry(key, idx, kernels, statics, None, out)

        def body():
            entry.out = rounds_forward(kernels, idx, scale, l2norm, *statics)[0]

        entry.graph = _EagerGraph(body)
        self.captures += 1
        return entry


def _plan(rollouts):
    ids, cu = pack([tokens(100, 0) + tokens(9 + i, 1 + i) for i in range(rollouts)])
    return build_plan(ids, cu, max_depth=4, level_cost=0)


def _inputs(c, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, c, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, c, 4, 8, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, c, 4, generator=gen, dtype=torch.float64))
    beta = torch.rand(1, c, 4, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def _forward(graphs, kernels, plan, layers=4):
    outs = []
    for layer in range(layers):
        inputs = _inputs(plan.compact_length, layer)
        out = graphs.run(kernels, plan.gdn, 8**-0.5, True, inputs) if graphs.applies(kernels, inputs) else None
        outs.append(rounds_forward(kernels, plan.gdn, 8**-0.5, True, *inputs)[0] if out is None else out)
    return outs


def test_a_forwards_first_layer_runs_eagerly_the_second_captures_and_the_rest_replay():
    graphs, kernels = _StandIn(), _Planned(reference_gdn)
    plan = _plan(3)
    with torch.no_grad():
        expected = [rounds_forward(kernels, plan.gdn, 8**-0.5, True, *_inputs(plan.compact_length, i))[0]
                    for i in range(4)]
        assert all(torch.equal(a, b) for a, b in zip(_forward(graphs, kernels, plan), expected))
        assert (graphs.captures, graphs.replays) == (1, 3)
        _forward(graphs, kernels, plan)  # the same plan again: every layer replays
        assert (graphs.captures, graphs.replays) == (1, 7)
        other = _plan(4)
        _forward(graphs, kernels, other)  # another plan: eager, then a capture of its own
        assert (graphs.captures, graphs.replays) == (2, 10)
        assert graphs.entry.idx is other.gdn
    with torch.inference_mode():  # another kind of forward (its tensors cannot be written outside it): captured anew
        _forward(graphs, kernels, other)
    assert (graphs.captures, graphs.replays) == (3, 13)
    graphs.release()
    assert graphs.entry is None


def test_the_graphs_serve_no_forward_that_needs_the_rounds_autograd_node_and_none_off_cuda():
    graphs, kernels = GDNCallGraphs(), _Planned(reference_gdn)
    inputs = [x.requires_grad_() for x in _inputs(8, 0)]
    assert not _StandIn().applies(kernels, inputs)  # grad mode on, inputs that want gradients: training
    with torch.no_grad():
        assert _StandIn().applies(kernels, inputs)
        assert not graphs.applies(kernels, inputs)  # CPU tensors
        assert not _StandIn(enabled=False).applies(kernels, inputs)
