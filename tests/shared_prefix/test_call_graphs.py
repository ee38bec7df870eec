"""When a scoring forward's plan ops (GDN rounds, conv) replay from a graph (`call_graphs.py`), on the CPU: which
calls the graphs serve, the order in which a forward's layers run eagerly, capture and replay, and a whole model's
scoring forward through them (a stand-in "captures" by keeping the op to run on the static inputs; the real graphs'
bit-equality is checked on the GPU, test_call_graphs_gpu.py)."""

import gc
import threading
import warnings
import weakref

import pytest
import torch
from patchgen.kernels.errors import SettingError
from patchgen.kernels.reference.gated_delta_rule import gated_delta_rule as reference_gdn
from patchgen.kernels.shared_prefix import build_plan, capture_guard
from patchgen.kernels.shared_prefix import call_graphs as call_graphs_module
from patchgen.kernels.shared_prefix.call_graphs import (
    ON_BY_DEFAULT,
    CallGraphs,
    CallGraphUnavailable,
    _Entry,
    enabled_in,
)
from patchgen.kernels.shared_prefix.gdn_rounds import ReferenceRounds, rounds_forward

from tests.models import tiny
from tests.models.prefix_trees import pack
from tests.shared_prefix.test_tree import tokens


class _EagerGraph:
    def __init__(self, body):
        self.body = body

    def replay(self, *live):
        self.body(*live)


class _StandIn(CallGraphs):
    """Serves CPU tensors and any kernels; a capture keeps the op, and a replay runs it on the static inputs."""

    def __init__(self, enabled: bool = True):
        super().__init__(enabled)

    def _serves(self, kernels, inputs):
        return not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs))

    def _capture(self, key, index, body, inputs, live=()):
        entry = _Entry(key, index, [x.clone() for x in inputs], None, torch.empty(0))

        def replay(*live):  # as a tape: the statics, and the live weights of the layer replayed
            entry.out = body(*entry.statics, *live)

        entry.graph = _EagerGraph(replay)
        self.captures += 1
        return entry


def _plan(rollouts):
    ids, cu = pack([tokens(100, 0) + tokens(9 + i, 1 + i) for i in range(rollouts)])
    return build_plan(ids, cu, max_depth=4, level_cost=0)


def _inputs(c, seed, qk_heads=2, v_heads=4):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, c, qk_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, c, v_heads, 8, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, c, v_heads, generator=gen, dtype=torch.float64))
    beta = torch.rand(1, c, v_heads, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


KERNELS = ReferenceRounds(reference_gdn)


def _rounds(plan, inputs):
    return rounds_forward(KERNELS, plan.gdn, 8**-0.5, True, *inputs)[0]


def _forward(graphs, plan, layers=4):
    """`layers` GDN layers of one forward: the plan's rounds on other inputs each, through `graphs`."""
    outs = []
    for layer in range(layers):
        inputs = _inputs(plan.compact_length, layer)
        out = graphs.run("gated_delta_rule", plan.gdn, (KERNELS, 8**-0.5, True), lambda *xs: _rounds(plan, xs), inputs)
        outs.append(_rounds(plan, inputs) if out is None else out)
    return outs


def test_the_first_pass_of_a_kind_captures_at_its_second_call_and_later_passes_at_their_first():
    """A process's first pass of a kind runs its first call eagerly (compiling and tuning its kernels) and captures
    its second; once one has run, a pass on a new plan captures at its first call (`capture_guard.py`)."""
    graphs, plan = _StandIn(), _plan(3)
    with torch.no_grad():
        expected = [_rounds(plan, _inputs(plan.compact_length, i)) for i in range(4)]
        assert all(torch.equal(a, b) for a, b in zip(_forward(graphs, plan), expected))
        assert (graphs.captures, graphs.replays) == (1, 3)
        _forward(graphs, plan)  # the same plan again: every layer replays
        assert (graphs.captures, graphs.replays) == (1, 7)
        other = _plan(4)
        expected = [_rounds(other, _inputs(other.compact_length, i)) for i in range(4)]
        # another plan: captured at its first call, every call replays
        assert all(torch.equal(a, b) for a, b in zip(_forward(graphs, other), expected))
        assert (graphs.captures, graphs.replays) == (2, 11)
        assert graphs.entries["gated_delta_rule"].index is other.gdn
    with torch.inference_mode():  # another kind of forward (its tensors cannot be written outside it): eager first
        _forward(graphs, other)
    assert (graphs.captures, graphs.replays) == (3, 14)
    graphs.release()
    assert not graphs.entries


def test_a_capture_is_made_only_where_the_calls_left_in_the_pass_pay_for_it():
    """A capture costs the host about two eager calls, a replay a sixth of one: with the longest of the last two
    forwards' passes of this kind as the guide, a pass captures (at its first call) only when it has three calls or
    more. The first forward has no guide: it captures at its second call."""
    graphs = _StandIn()
    with torch.no_grad():
        _forward(graphs, _plan(3), layers=2)
        assert (graphs.captures, graphs.replays) == (1, 1)
        _forward(graphs, _plan(4), layers=2)  # two calls a pass: a capture would have two replays
        assert (graphs.captures, graphs.replays) == (1, 1)
        assert not graphs.entries  # the last plan's graph went, its memory with it
        _forward(graphs, _plan(5), layers=4)  # guided by the last passes (2, 2): eager throughout
        assert (graphs.captures, graphs.replays) == (1, 1)
        _forward(graphs, _plan(3), layers=4)  # guided by a pass of 4
        assert (graphs.captures, graphs.replays) == (2, 5)
        graphs.release()  # a training step in between keeps the guide: the passes of the model are as long
        _forward(graphs, _plan(4), layers=3)
        assert (graphs.captures, graphs.replays) == (3, 8)
        _forward(graphs, _plan(5), layers=2)  # the longest of the last two passes (4, 3) as the guide: captured
        assert (graphs.captures, graphs.replays) == (4, 10)
        _forward(graphs, _plan(3), layers=2)  # passes of (3, 2): three calls, captured
        assert (graphs.captures, graphs.replays) == (5, 12)
        _forward(graphs, _plan(4), layers=2)  # passes of (2, 2): eager
        assert (graphs.captures, graphs.replays) == (5, 12)


class _ColdStandIn(_StandIn):
    """A capture meets, while `cold`, a Triton kernel not loaded yet: it calls the hook Triton calls before a load."""

    def __init__(self):
        super().__init__()
        self.cold = False

    def _capture(self, key, index, body, inputs, live=()):
        if self.cold:
            capture_guard._on_kernel_load(None, None, "a_kernel_of_new_shapes")
        return super()._capture(key, index, body, inputs, live)


def test_a_first_calls_capture_that_meets_a_kernel_not_made_yet_runs_the_call_eagerly_and_the_next_captures():
    """A first call's capture is watched (a new kernel would compile, or an autotuner benchmark, under it); the
    second call of a pass follows an eager call and is not."""
    graphs = _ColdStandIn()
    with torch.no_grad():
        _forward(graphs, _plan(3))
        assert (graphs.captures, graphs.replays, graphs.not_warm) == (1, 3, 0)
        graphs.cold, plan = True, _plan(4)
        expected = [_rounds(plan, _inputs(plan.compact_length, i)) for i in range(4)]
        assert all(torch.equal(a, b) for a, b in zip(_forward(graphs, plan), expected))
        # the first call's capture dropped, the call run eagerly; the second captured as a first pass's does
        assert (graphs.captures, graphs.replays, graphs.not_warm) == (2, 6, 1)
        assert graphs.enabled
        graphs.cold = False
        _forward(graphs, _plan(5))
        assert (graphs.captures, graphs.replays, graphs.not_warm) == (3, 10, 1)


@pytest.mark.parametrize("unwatched", ["no load hooks", "CuTe DSL installed"])
def test_where_a_capture_cannot_be_watched_a_pass_runs_its_first_call_eagerly(unwatched, monkeypatch):
    """Without Triton's load hooks nothing is watched; FA4 and liger's CuTe backends compile with a compiler the hooks
    do not see."""
    if unwatched == "no load hooks":
        monkeypatch.setattr(capture_guard, "_load_hooks", lambda: None)
        monkeypatch.setattr(capture_guard, "_hooked", False)
    else:
        monkeypatch.setattr(capture_guard, "cute_dsl_installed", lambda: True)
    assert not capture_guard.available()
    graphs = _StandIn()
    with torch.no_grad():
        _forward(graphs, _plan(3))
        _forward(graphs, _plan(4))
    assert (graphs.captures, graphs.replays) == (2, 6)


def test_a_thread_runs_its_own_first_pass_of_a_kind_eagerly():
    """What a thread makes on first use (its cuBLAS handle) must not be made under a capture: a thread new to a kind
    runs its first call eagerly even where another thread has warmed the kind."""
    graphs = _StandIn()
    with torch.no_grad():
        _forward(graphs, _plan(3))
        assert (graphs.captures, graphs.replays) == (1, 3)

        def score():
            with torch.no_grad():
                _forward(graphs, _plan(4))

        thread = threading.Thread(target=score)
        thread.start()
        thread.join()
        assert (graphs.captures, graphs.replays) == (2, 6)  # eager, then captured at the second call
        _forward(graphs, _plan(5))  # this thread again: captured at the first
        assert (graphs.captures, graphs.replays) == (3, 10)


def test_a_model_of_other_widths_is_a_kind_of_its_own():
    """Its kernels are other kernels (constexpr widths): its first pass runs its first call eagerly."""
    graphs = _StandIn()
    with torch.no_grad():
        _forward(graphs, _plan(3))
        plan = _plan(4)
        for layer in range(4):
            inputs = _inputs(plan.compact_length, layer, qk_heads=3, v_heads=3)  # a model of other widths
            out = graphs.run("gated_delta_rule", plan.gdn, (KERNELS, 8**-0.5, True), lambda *xs: _rounds(plan, xs),
                             inputs)
            assert (out is None) == (layer == 0)
            assert torch.equal(_rounds(plan, inputs) if out is None else out, _rounds(plan, inputs))
    assert (graphs.captures, graphs.replays) == (2, 6)


def test_the_pass_a_release_interrupts_still_guides_the_next():
    """A training step releases the graphs after each scoring forward (one micro-batch of old-policy log-probs, then
    the update): that forward's passes guide the next forward's as a pass that another ended does."""
    graphs = _StandIn()
    with torch.no_grad():
        _forward(graphs, _plan(3), layers=2)  # no guide yet: captured
        assert (graphs.captures, graphs.replays) == (1, 1)
        graphs.release()
        _forward(graphs, _plan(4), layers=2)  # a pass of 2 as the guide: the capture would have one replay
        assert (graphs.captures, graphs.replays) == (1, 1)
        graphs.release()
        _forward(graphs, _plan(5), layers=2)
        assert (graphs.captures, graphs.replays) == (1, 1)


def test_a_deep_model_scoring_in_turn_with_a_shallow_one_of_its_kind_still_captures():
    """Two models whose layers are of one kind (widths aside) score in turn, a deep one and one with two layers of the
    kind (a draft or a small reward model): the shallow one's passes must not talk the deep one out of its captures,
    which pay for themselves many times over."""
    graphs = _StandIn()
    with torch.no_grad():
        for step in range(3):
            captures, replays = graphs.captures, graphs.replays
            _forward(graphs, _plan(3 + step), layers=6)
            # the first pass captures at its second call, the later ones at their first
            assert (graphs.captures - captures, graphs.replays - replays) == (1, 5 if step == 0 else 6)
            _forward(graphs, _plan(3 + step), layers=2)


class _WatchingStandIn(_StandIn):
    """Notes, at each capture, whether the graph it replaces is still alive."""

    def __init__(self):
        super().__init__()
        self.replaced_alive, self._last = [], None

    def _capture(self, key, index, body, inputs, live=()):
        gc.collect()  # a stand-in graph sits in a reference cycle: alive here only if something still holds it
        self.replaced_alive.append(self._last is not None and self._last() is not None)
        entry = super()._capture(key, index, body, inputs, live)
        self._last = weakref.ref(entry.graph)
        return entry


def test_a_replaced_graph_lives_until_its_successor_is_captured():
    """torch 2.11 fails a capture into a memory pool whose last graph is gone (its host allocator asserts): a forward on
    a new plan captures while the last plan's graph still holds the pool."""
    graphs = _WatchingStandIn()
    with torch.no_grad():
        for rollouts in (3, 4, 5):
            _forward(graphs, _plan(rollouts))
    assert graphs.replaced_alive == [False, True, True]


def test_the_graphs_serve_no_forward_that_needs_an_autograd_node_and_none_off_cuda():
    inputs = [x.requires_grad_() for x in _inputs(8, 0)]
    assert not _StandIn().applies(KERNELS, inputs)  # grad mode on, inputs that want gradients: training
    with torch.no_grad():
        assert _StandIn().applies(KERNELS, inputs)
        assert not _StandIn(enabled=False).applies(KERNELS, inputs)
        assert not CallGraphs().applies(KERNELS, inputs)  # CPU tensors


def _gdn_heavy_model():
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    return tiny.build("qwen3_5", "gpu", shared_prefix_training=True, num_hidden_layers=4, layer_types=layer_types)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_models_scoring_forward_through_the_graphs_equals_its_eager_forward(mode, monkeypatch):
    net = _gdn_heavy_model().eval()
    # the GDN slot's rounds as one node (on the GPU: fla's or our stages), as the graphs serve them
    rounds = {}  # one per backend function, as a backend's `rounds` attribute is
    monkeypatch.setattr("patchgen.kernels.shared_prefix.gdn.round_kernels",
                        lambda fn, dtype: rounds.setdefault(fn, ReferenceRounds(fn)))
    ids, cu, _ = tiny.grpo_batch([(70, [9, 14, 5]), (66, [12, 3])], singles=[11])
    with mode():
        eager = net(input_ids=ids, return_log_probs=True, return_logits=False, **tiny.packed_kwargs(cu)).log_probs
    stand_in = _StandIn()
    monkeypatch.setattr(call_graphs_module, "CALL_GRAPHS", stand_in)
    monkeypatch.setattr("patchgen.kernels.shared_prefix.gdn.CALL_GRAPHS", stand_in)
    monkeypatch.setattr("patchgen.kernels.shared_prefix.conv.CALL_GRAPHS", stand_in)
    with mode():
        replayed = net(input_ids=ids, return_log_probs=True, return_logits=False, **tiny.packed_kwargs(cu)).log_probs
    assert torch.equal(replayed, eager)
    # three GDN layers: per op, the first eager, the second captured and replayed, the third replayed
    assert (stand_in.captures, stand_in.replays) == (2, 4)
    assert set(stand_in.entries) == {"gated_delta_rule", "causal_conv1d"}


def test_the_environment_turns_them_on_or_off_and_a_wrong_value_is_an_error():
    assert enabled_in({"PATCHGEN_CALL_GRAPHS": "1"}) and not enabled_in({"PATCHGEN_CALL_GRAPHS": "0"})
    assert enabled_in({}) is ON_BY_DEFAULT
    with pytest.raises(SettingError, match="PATCHGEN_CALL_GRAPHS='yes'.*expected 1 \\(on\\) or 0 \\(off\\)"):
        enabled_in({"PATCHGEN_CALL_GRAPHS": "yes"})


def test_a_replay_reads_its_own_inputs_while_another_thread_scores_on_the_same_plan(monkeypatch):
    """Two threads score on one plan (a reference model and the old policy, say, which `PlanReuse` hands the same
    plan): the other thread's copy into the static inputs must not land between this thread's copy and replay."""
    import threading

    graphs, plan = _StandIn(), _plan(3)
    with torch.no_grad():
        _forward(graphs, plan, layers=2)  # the graph is held
    first, second = _inputs(plan.compact_length, 10), _inputs(plan.compact_length, 11)
    second_copied = threading.Event()
    copy = torch._foreach_copy_

    def copy_and_tell(dst, src):
        copy(dst, src)
        if threading.current_thread().name == "second":
            second_copied.set()

    monkeypatch.setattr(torch, "_foreach_copy_", copy_and_tell)
    replay = graphs.entries["gated_delta_rule"].graph.body

    def slow_replay():  # the first thread's replay lingers until the second has copied (or half a second)
        if threading.current_thread().name == "first":
            threading.Thread(target=score, args=(second, "second"), name="second").start()
            second_copied.wait(0.5)
        replay()

    graphs.entries["gated_delta_rule"].graph.body = slow_replay
    outs, done = {}, []

    def score(inputs, name):
        with torch.no_grad():
            outs[name] = graphs.run("gated_delta_rule", plan.gdn, (KERNELS, 8**-0.5, True),
                                    lambda *xs: _rounds(plan, xs), inputs)
        done.append(name)

    runner = threading.Thread(target=score, args=(first, "first"), name="first")
    runner.start()
    runner.join(10)
    for _ in range(1000):
        if len(done) == 2:
            break
        threading.Event().wait(0.01)
    assert sorted(done) == ["first", "second"]
    with torch.no_grad():
        assert torch.equal(outs["first"], _rounds(plan, first))
        assert torch.equal(outs["second"], _rounds(plan, second))


def test_the_layer_stack_warm_ups_hold_the_call_graphs_off(monkeypatch):
    """A layer-stack warm-up routes every allocation of the device into its pool (`allocating_to`), a call graph's
    capture included: no call graph is captured or replayed inside one."""
    from patchgen.kernels.graphs import replay as replay_module

    for name in ("_cuda_beginAllocateToPool", "_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(torch._C, name, lambda *args: None, raising=False)
    stand_in = _StandIn()
    monkeypatch.setattr(call_graphs_module, "CALL_GRAPHS", stand_in)
    inputs = _inputs(8, 0)
    with torch.no_grad():
        assert stand_in.applies(KERNELS, inputs)
        with replay_module.allocating_to(type("Pool", (), {"id": (1, 0)})(), torch.device("cuda", 0)):
            assert not stand_in.applies(KERNELS, inputs)
        assert stand_in.applies(KERNELS, inputs)


def test_releasing_at_exit_never_waits_for_ever_on_a_thread_stopped_mid_replay():
    graphs, plan = _StandIn(), _plan(3)
    with torch.no_grad():
        _forward(graphs, plan, layers=2)
    graphs._lock.acquire()  # a daemon thread's replay, stopped by the exit
    try:
        assert graphs.release(timeout=0.05) is False and graphs.entries
    finally:
        graphs._lock.release()
    assert graphs.release(timeout=0.05) is True and not graphs.entries


class _Pool:
    """A capture pool as torch 2.11 keeps it: a capture into one whose graphs are all gone fails (its host allocator
    asserts), and its working memory stays reserved while it is kept."""

    def __init__(self):
        self.graphs = weakref.WeakSet()
        self.captured = False


class _PoolStandIn(_StandIn):
    """Captures into one `_Pool` per device, as `CallGraphs._capture` does."""

    def _capture_stream_and_pool(self, device):
        found = self._capture_on.get(device)
        if found is None:
            found = self._capture_on[device] = (_Pool(), None)
        return found

    def _capture(self, key, index, body, inputs, live=()):
        pool, _ = self._capture_stream_and_pool(inputs[0].device)
        gc.collect()  # a stand-in graph sits in a reference cycle
        if pool.captured and not pool.graphs:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        entry = super()._capture(key, index, body, inputs, live)
        pool.captured = True
        pool.graphs.add(entry.graph)
        return entry


class _Index:
    """A plan's index (held by weak reference)."""


def _device_forward(graphs, device, gdn: int, attention: int = 0) -> None:
    """A forward on a plan of its own of a model on `device`: its GDN layers, then its attention layers."""
    index = _Index()
    for op, calls in (("gdn", gdn), ("attention", attention)):
        for layer in range(calls):
            x = torch.full((4,), float(layer), device=device)
            graphs.run(op, index, (), lambda x: x * 2, [x])


def _pools_hold_graphs(graphs) -> bool:
    gc.collect()  # a stand-in graph sits in a reference cycle
    return all(pool.graphs for pool, _ in graphs._capture_on.values())


def test_models_on_two_devices_capture_into_pools_that_hold_graphs_and_keep_no_pool_without_one():
    """A policy and a reference model on two devices of one process, scoring in turn: each capture on a device whose
    graphs the other model's captures replaced goes into a new pool (torch 2.11 fails one into a pool whose graphs
    are all gone), and no device keeps a pool, with its working memory, that holds no graph."""
    graphs = _PoolStandIn()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", CallGraphUnavailable)
        for device in ("cpu", "meta", "cpu", "meta"):
            _device_forward(graphs, device, gdn=4, attention=4)  # each kind captured, the other device's replaced
            assert _pools_hold_graphs(graphs)
        for _ in range(2):  # guided by a pass of 4: captured
            _device_forward(graphs, "cpu", gdn=2)
        _device_forward(graphs, "cpu", gdn=2)  # guided by passes of 2: the last plan's graph goes, not captured
        assert set(graphs.entries) == {"attention"} and _pools_hold_graphs(graphs)
        _device_forward(graphs, "cpu", gdn=4)  # guided by passes of 2: eager
        _device_forward(graphs, "cpu", gdn=4)  # guided by a pass of 4: captured
        assert _pools_hold_graphs(graphs)
    assert graphs.enabled and graphs.captures == 11
