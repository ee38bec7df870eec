"""Layer captures split at their linears (`shared_prefix/graph_tape.py`) replayed on the CPU the way CUDA graphs
replay: each segment between two linears records the aten ops it ran on the tensors it ran them on, and a replay
runs those ops again on the same tensors (the statics, the linears' buffers, the segment's own intermediates) with
the host state of the capture baked in, while each linear runs the tape's `mm` on the replayed layer's weight. So a
replay that read another layer's weight, a stale input or a buffer overwritten before it is read gives other values
than the eager layers, which these tests compare bit for bit on small layers of the shapes a decoder layer takes."""

import threading
import warnings

import pytest
import torch
from patchgen.kernels.modeling import scoring_layers
from patchgen.kernels.modeling.shared_prefix import KWARG
from patchgen.kernels.shared_prefix import call_graphs as call_graphs_module
from patchgen.kernels.shared_prefix import capture_guard
from patchgen.kernels.shared_prefix.call_graphs import CallGraphs, _Entry
from patchgen.kernels.shared_prefix.graph_tape import Tape, _Linear
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.models import lora_like


class _Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class _SegmentGraph:
    """A CUDA graph's stand-in: the ops between `capture_begin` and `capture_end`, run again by `replay` on the tensors
    they were captured on, each output written where the capture's output lies (a graph's kernels write the addresses
    they were captured with). Unlike a CUDA graph the capture computes too: its values are thrown away at the replay
    that follows it, as a graph's would be."""

    def capture_begin(self, pool=None, capture_error_mode=None):
        self.recording = _Recording()
        self.recording.__enter__()

    def capture_end(self):
        self.recording.__exit__(None, None, None)
        if not self.recording.ops:  # as torch warns at the end of a capture that recorded no kernel
            warnings.warn("The CUDA Graph is empty. This usually means that the graph was attempted to be captured "
                          "on wrong device or stream.", UserWarning, stacklevel=2)

    def replay(self):
        self.replays = getattr(self, "replays", 0) + 1
        # a CUDA graph runs the kernels it captured whatever autocast says at replay
        with torch.autocast("cpu", enabled=False):
            for func, args, kwargs, out in self.recording.ops:
                fresh = func(*args, **kwargs)
                for captured, now in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                    if isinstance(captured, torch.Tensor) and captured is not now:
                        captured.copy_(now)


class _TapeStandIn(CallGraphs):
    """The layer graphs on the CPU: captures on a real `Tape` of `_SegmentGraph`s."""

    on_device = staticmethod(lambda x: True)

    def __init__(self):
        super().__init__(enabled=True)
        self.tapes = []

    def _capture(self, key, index, body, inputs, live=()):
        statics = [x.clone() for x in inputs]
        tape = Tape(None, None, graph_type=_SegmentGraph)
        out = tape.record(body, statics, live)
        self.tapes.append(tape)
        self.captures += 1
        return _Entry(key, index, statics, tape, out)


@pytest.fixture(autouse=True)
def every_linear_live(monkeypatch):
    """At these widths every linear is small (`MIN_LIVE_BYTES`): take every one out of the graphs, as the big ones are
    at a model's widths."""
    monkeypatch.setattr(scoring_layers, "MIN_LIVE_BYTES", 0)


@pytest.fixture
def tape_graphs(monkeypatch):
    stand_in = _TapeStandIn()
    monkeypatch.setattr(call_graphs_module, "LAYER_GRAPHS", stand_in)
    return stand_in


class _Plan:
    """The plan a forward's layers share (keyed by identity)."""


WIDTH, HEADS, INNER = 16, 2, 24


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _SubclassedLinear(torch.nn.Linear):
    """An `nn.Linear` subclass that keeps its forward (quantisation-aware wrappers, torch's NonDynamicallyQuantizable)."""


class _Layer(torch.nn.Module):
    """A decoder layer's shapes of linear use: q, k and v in a row (empty graphs between them), a fused projection
    split by slices, a linear on the layer's own input and one on a keyword tensor, one called twice, one whose
    output is changed in place, one whose input is changed in place after it ran, a weight tied between two
    linears, a subclass, and a linear whose output is the layer's output."""

    def __init__(self):
        super().__init__()
        self.norm = _Norm()
        self.q, self.k, self.v = (torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.fused = torch.nn.Linear(WIDTH, 2 * INNER, bias=False)
        self.side = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.gate = torch.nn.Linear(WIDTH, WIDTH, bias=True)  # with a bias: captured on its static copies
        self.again = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.tied = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.tied_too = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.tied_too.weight = self.tied.weight
        self.sub = _SubclassedLinear(INNER, WIDTH, bias=False)
        self.down = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, hidden, shared_prefix=None, extra=None):
        residual = hidden
        h = self.norm(hidden)
        q, k, v = self.q(h), self.k(h), self.v(h)
        scores = torch.softmax(q.view(*q.shape[:-1], HEADS, -1) * k.view(*k.shape[:-1], HEADS, -1), dim=-1)
        attended = (scores * v.view(*v.shape[:-1], HEADS, -1)).flatten(-2)
        up, gate = self.fused(attended).split(INNER, dim=-1)
        mixed = self.sub(F.silu(gate) * up)
        mixed.mul_(0.5)  # in place on a linear's buffer
        side = self.side(hidden) + self.side(extra)  # the layer's own (static) input, a keyword tensor
        h = mixed + side + torch.sigmoid(self.gate(h))
        h = self.again(self.again(h))
        t = self.tied_too(self.tied(h))
        h.add_(1.0)  # in place on an input a linear read
        return self.down(residual + t + h)  # a linear's buffer as the layer's output


def _layers(count: int, cls=_Layer, seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    layers = [cls().eval() for _ in range(count)]
    with torch.no_grad():
        for layer in layers:  # every layer its own weights: a replay on another layer's would show
            for p in layer.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
    return layers


def _forward(layers, hidden, extra, plan, replayed: bool):
    call = scoring_layers._replayed if replayed else scoring_layers._as_it_is
    for layer in layers:
        hidden = call(layer, hidden, **{KWARG: plan, "extra": extra})
    return hidden


def _inputs(seed: int, rows: int = 11):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, rows, WIDTH, generator=gen), torch.randn(1, rows, WIDTH, generator=gen)


class _LoadsAKernelLast(_Layer):
    """A layer that, while `cold`, launches a Triton kernel not loaded yet after all its linears."""

    cold = False

    def forward(self, hidden, shared_prefix=None, extra=None):
        out = super().forward(hidden, shared_prefix, extra)
        if _LoadsAKernelLast.cold:
            capture_guard._on_kernel_load(None, None, "a_kernel_of_new_shapes")
        return out * 0.5


def test_a_first_layers_capture_that_meets_a_kernel_not_loaded_yet_ends_its_graphs_and_runs_eagerly(
        tape_graphs, monkeypatch):
    """The capture is dropped with the graphs it had ended and the one it had open, and the layer runs eagerly; the
    next layer is captured after it, as a first pass's second layer is."""
    layers = _layers(4, cls=_LoadsAKernelLast)
    with torch.no_grad():
        _forward(layers, *_inputs(0), _Plan(), replayed=True)  # a pass of the kind has run
        monkeypatch.setattr(_LoadsAKernelLast, "cold", True)
        hidden, extra = _inputs(1)
        expected = _forward(layers, hidden, extra, _Plan(), replayed=False)
        got = _forward(layers, hidden, extra, _Plan(), replayed=True)
    assert torch.equal(got, expected)
    assert (tape_graphs.captures, tape_graphs.not_warm, len(tape_graphs.tapes)) == (2, 1, 2)
    assert torch._C._len_torch_dispatch_stack() == 0  # no segment left recording


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_layers_replayed_from_a_tape_equal_the_eager_layers(mode, tape_graphs):
    layers = _layers(5)
    with mode():
        for seed in (0, 1):  # a second forward on another plan: captured anew, at its first layer
            hidden, extra = _inputs(seed)
            expected = _forward(layers, hidden, extra, _Plan(), replayed=False)
            got = _forward(layers, hidden, extra, _Plan(), replayed=True)
            assert torch.equal(got, expected)
    assert (tape_graphs.captures, tape_graphs.replays) == (2, 9)
    tape = tape_graphs.tapes[-1]
    linears = [step for step in tape.steps if isinstance(step, _Linear)]
    # q, k, v, fused, sub, side twice, again twice, tied twice on one weight (tied_too's is tied's), down
    assert len(linears) == 12 and len({step.at for step in linears}) == 9


def test_the_empty_graphs_between_linears_in_a_row_are_held_and_never_replayed(tape_graphs):
    """q, k and v in a row leave nothing to capture between them: those graphs' launches would cost a replay's host
    time for nothing, so the tape holds them without running them, and the output stays the eager layers'."""
    layers = _layers(4)
    hidden, extra = _inputs(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # the empty graphs' warnings are the tape's to take, not the user's to see
        expected = _forward(layers, hidden, extra, _Plan(), replayed=False)
        assert torch.equal(_forward(layers, hidden, extra, _Plan(), replayed=True), expected)
    tape = tape_graphs.tapes[-1]
    graphs = [step for step in tape.steps if isinstance(step, _SegmentGraph)]
    # nothing between q and k, k and v, the two calls of `side` and of `again`, `again` and `tied`, `tied` and
    # `tied_too`, nor after `down`, whose buffer is the layer's output
    assert len(tape.idle) == 7 and all(not graph.recording.ops for graph in tape.idle)
    assert all(graph.recording.ops for graph in graphs)
    assert all(getattr(graph, "replays", 0) == 0 for graph in tape.idle)
    assert all(graph.replays == 3 for graph in graphs)  # the captured layer and the two after it


def test_a_small_linear_stays_in_the_graph_on_copies_of_each_layers_weight(tape_graphs, monkeypatch):
    """A linear whose weight is under `MIN_LIVE_BYTES` is captured with the small weights, copied in per layer: its
    segment break would cost more host time than its copy costs the device. Only the fused projection (3 KB here) is
    left out; every replay still reads its own layer's weights."""
    monkeypatch.setattr(scoring_layers, "MIN_LIVE_BYTES", 2048)
    layers = _layers(4)
    hidden, extra = _inputs(0)
    with torch.no_grad():
        expected = _forward(layers, hidden, extra, _Plan(), replayed=False)
        assert torch.equal(_forward(layers, hidden, extra, _Plan(), replayed=True), expected)
    assert tape_graphs.replays == 3
    tape = tape_graphs.tapes[-1]
    assert {step.at for step in tape.steps if isinstance(step, _Linear)} == {0}  # the fused projection, once
    entry = next(iter(tape_graphs.entries.values()))
    static_weights = {tuple(s.shape) for s in entry.statics}
    assert (WIDTH, WIDTH) in static_weights and (2 * INNER, WIDTH) not in static_weights


def test_a_captures_other_warnings_reach_the_user():
    class _Warning(_SegmentGraph):
        def capture_end(self):
            super().capture_end()
            warnings.warn("something else", UserWarning, stacklevel=2)

    tape = Tape(None, None, graph_type=_Warning)
    weight = torch.randn(WIDTH, WIDTH)
    with torch.no_grad(), pytest.warns(UserWarning, match="something else"):
        tape.record(lambda x, w: F.linear(x, w).relu(), [torch.randn(3, WIDTH)], [weight])
    # the linear came first: an empty graph before it, held; the full one after it kept
    assert len(tape.steps) == 2 and len(tape.idle) == 1


def test_an_empty_capture_in_another_thread_is_never_taken_for_this_ones():
    """The warning filter is the process's: another thread ending an empty capture while this one ends a full one must
    not make this one's graph pass for empty (it would never replay: silently wrong outputs)."""
    ended, other_done = threading.Event(), threading.Event()

    class _SlowEnd(_SegmentGraph):
        def capture_end(self):
            super().capture_end()
            ended.set()
            other_done.wait(5)  # the other thread's empty capture ends while this one's is ending

    def other_thread():
        ended.wait(5)
        try:  # as torch warns at an empty capture's end: through the process's filters (here this one's "error")
            warnings.warn("The CUDA Graph is empty. This usually means ...", UserWarning, stacklevel=1)
        except UserWarning:
            pass
        other_done.set()

    threading.Thread(target=other_thread).start()
    tape = Tape(None, None, graph_type=_SlowEnd)
    with torch.no_grad():
        tape.record(lambda x: (x * 2).relu(), [torch.randn(3, WIDTH)], [])
    assert len(tape.steps) == 1 and not tape.idle


def test_a_replay_on_a_kept_plan_after_the_weights_change_reads_the_new_weights(tape_graphs):
    """The linears' weights are never copied: a replay must read them where they are, changed in place (an optimizer
    step between two scoring forwards on one plan, PEFT merging an adapter)."""
    layers, plan = _layers(4), _Plan()
    hidden, extra = _inputs(0)
    with torch.no_grad():
        _forward(layers, hidden, extra, plan, replayed=True)
        for layer in layers:
            layer.down.weight.mul_(-2.0)
            layer.tied.weight.add_(0.1)
        expected = _forward(layers, hidden, extra, plan, replayed=False)
        replays = tape_graphs.replays
        assert torch.equal(_forward(layers, hidden, extra, plan, replayed=True), expected)
        assert tape_graphs.replays - replays == 4


class _AdaptedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, INNER, bias=False)
        self.down = torch.nn.Linear(INNER, WIDTH, bias=False)
        lora_like.wrap(self, "down")

    def forward(self, hidden, shared_prefix=None, extra=None):
        return hidden + self.down(F.silu(self.up(hidden)) * extra.sum())


def test_lora_adapters_on_and_off_replay_their_own_branch_on_each_layers_weights(tape_graphs):
    layers, plan = _layers(4, _AdaptedLayer), _Plan()
    hidden, extra = _inputs(0)
    with torch.no_grad():
        policy = _forward(layers, hidden, extra, plan, replayed=False)
        assert torch.equal(_forward(layers, hidden, extra, plan, replayed=True), policy)
        for layer in layers:
            layer.down._disable_adapters = True
        reference = _forward(layers, hidden, extra, plan, replayed=False)
        assert not torch.equal(reference, policy)
        assert torch.equal(_forward(layers, hidden, extra, plan, replayed=True), reference)
    assert tape_graphs.captures == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layers_under_autocast_replay_the_casts_the_eager_layers_make(dtype, tape_graphs):
    """Mixed precision around a model kept in float32 (accelerate's autocast): the linears run in bfloat16, their
    inputs and weights cast. A float64 model's linears autocast leaves as they are (it casts no double)."""
    layers = [layer.to(dtype) for layer in _layers(4)]
    hidden, extra = (x.to(dtype) for x in _inputs(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _forward(layers, hidden, extra, _Plan(), replayed=False)
        got = _forward(layers, hidden, extra, _Plan(), replayed=True)
    # in float32 the first layer hands the second bfloat16 (the last linear's output): the second's key is new
    assert tape_graphs.replays == (2 if dtype == torch.float32 else 3)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


class _Racing(_AdaptedLayer):
    """A layer that, while it is captured, lets another thread run it eagerly: two threads scoring on one model, the
    second running this layer as it is (its first layer of a kind, a training forward) while the first captures it
    under `functional_call`, which swaps the module's weights for the capture's in place."""

    meanwhile = None

    def forward(self, hidden, shared_prefix=None, extra=None):
        if self.meanwhile is not None:
            self.meanwhile()
        return super().forward(hidden, shared_prefix, extra)


def once_in_another_thread(module, call) -> dict:
    """Have `module`'s next forward (a `_Racing` one: at the capture) run `call()` in another thread and wait for it;
    the dict returned gets its "out", or the "error" it raised."""
    seen = {}

    def other_thread():
        try:
            with torch.no_grad():
                seen["out"] = call()
        except Exception as error:  # noqa: BLE001 - the failure is what the test reports
            seen["error"] = error

    def run_other_thread():
        del module.meanwhile  # once
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()

    module.meanwhile = run_other_thread
    return seen


def test_another_thread_running_a_layer_while_it_is_captured_reads_its_real_weights(tape_graphs):
    layers, plan = _layers(4, _Racing), _Plan()
    hidden, extra = _inputs(0)
    other_hidden, _ = _inputs(1)
    with torch.no_grad():
        expected = _forward(layers, hidden, extra, plan, replayed=False)
        expected_other = layers[1](other_hidden, extra=extra)
    seen = once_in_another_thread(layers[1], lambda: layers[1](other_hidden, extra=extra))
    with torch.no_grad():
        got = _forward(layers, hidden, extra, plan, replayed=True)
    assert tape_graphs.captures == 1 and "meanwhile" not in vars(layers[1])
    assert "error" not in seen and torch.equal(seen["out"], expected_other)
    assert torch.equal(got, expected)


class _UnregisteredLinear(torch.nn.Module):
    """A projection kept in a plain list, out of the module's tables (so that it is not a submodule): the walk of the
    layer's weights does not reach it."""

    def __init__(self):
        super().__init__()
        self.norm = _Norm()
        self.side = [torch.nn.Linear(WIDTH, WIDTH, bias=False)]

    def forward(self, hidden, shared_prefix=None, extra=None):
        return hidden + self.side[0](self.norm(hidden))


def test_a_layer_holding_a_module_outside_its_tables_runs_as_it_is(tape_graphs):
    """A replay would run the linear on the captured layer's weight, which the capture read where it is."""
    layers = _layers(4, _UnregisteredLinear)
    with torch.no_grad():
        for layer in layers:
            layer.side[0].weight.copy_(torch.randn(WIDTH, WIDTH))
        hidden, extra = _inputs(0)
        expected = _forward(layers, hidden, extra, _Plan(), replayed=False)
        assert torch.equal(_forward(layers, hidden, extra, _Plan(), replayed=True), expected)
    assert tape_graphs.captures == 0
    assert scoring_layers._walk(_Layer()) is not None  # a module's own submodules are walked


class _Mixed(torch.nn.Module):
    """A bfloat16 layer with a float32 linear (a router kept in float32) and a linear on a view whose rows do not fold
    without a copy (`refold` set): the one replays on its own casts, the other is refused at the capture."""

    refold = False

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.router = torch.nn.Linear(WIDTH, 4, bias=False)

    def forward(self, hidden, shared_prefix=None, extra=None):
        weights = torch.softmax(self.router(hidden.float()), dim=-1).to(hidden.dtype)
        h = hidden.transpose(0, 1) if self.refold else hidden
        up = self.up(h)
        return hidden + (up.transpose(0, 1) if self.refold else up) * weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("refold", [False, True])
def test_a_layer_of_mixed_dtypes_replays_and_one_that_would_not_fold_runs_as_it_is(refold, tape_graphs):
    layers = _layers(4, _Mixed)
    for layer in layers:
        layer.up.to(torch.bfloat16)
        layer.refold = refold
    hidden = torch.randn(3, 5, WIDTH, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = _forward(layers, hidden, None, _Plan(), replayed=False)
        if refold:
            with pytest.warns(call_graphs_module.CallGraphUnavailable, match="cannot replay as one mm"):
                got = _forward(layers, hidden, None, _Plan(), replayed=True)
        else:
            got = _forward(layers, hidden, None, _Plan(), replayed=True)
    assert torch.equal(got, expected)
    assert tape_graphs.replays == (0 if refold else 3)


def test_the_generated_layers_replay_from_tapes_bit_for_bit(tape_graphs):
    """The generated decoder layers (GDN and attention), each of a kind on weights of its own, replayed segment by
    segment with their linears on each layer's weight."""
    from tests.shared_prefix.test_scoring_layers import _batch, _eager, _log_probs, _model

    net, (ids, cu, _) = _model(), _batch()
    with torch.no_grad():
        for i, layer in enumerate(net.model.layers):
            for p in layer.parameters():
                p.mul_(1.0 + 0.1 * i)
        expected = _eager(net, ids, cu)
        assert torch.equal(_log_probs(net, ids, cu), expected)
    assert (tape_graphs.captures, tape_graphs.replays) == (2, 4)
    assert all(any(isinstance(step, _Linear) for step in tape.steps) for tape in tape_graphs.tapes)
