"""``"auto"`` in `shared_prefix_cuda_graphs_training` / `_scoring`: per call, a graph replay on the padded bucket or an
eager call on the unpadded plan, whichever this model has measured faster (`graphs/choice.py`).

The chooser's rules on measured times fed in; then the models (CPU, float64, `EagerReplay`): whichever way a call
runs, loss, logits and gradients are the model's without graphs, and the plan is padded exactly when it replays;
CPU timings are measured (host clock) for both ways and both modes."""

import statistics

import pytest
import torch
from patchgen.kernels.graphs import EagerReplay
from patchgen.kernels.graphs.choice import EAGER, REPLAY, Phase, ReplayOrEager, fit_call_time
from patchgen.kernels.modeling import layer_graphs, shared_prefix

from tests.models import tiny


def _measure(choice, mode, way, work, ms):
    timing = choice.timing(mode, way, work, torch.device("cpu"))
    timing.phases.append(Phase(0.0, None, ms / 1e3))


def _learnt(replay_rate, eager_rate, mode="score"):
    """A chooser past its first calls, with these ms per unit of work measured for each way (after a first call each
    way that is left out: a compile's time)."""
    choice = ReplayOrEager()
    assert choice.pads(mode, 100, 110, held=False)  # the first call captures
    for ms in (1e4, 110 * replay_rate):
        assert choice.pads(mode, 100, 110, held=True)  # replays until one is measured
        _measure(choice, mode, REPLAY, 110, ms)
    for ms in (1e4, 100 * eager_rate):
        assert not choice.pads(mode, 100, 110, held=True)  # then eager calls until one is measured
        _measure(choice, mode, EAGER, 100, ms)
    return choice


def test_the_first_call_captures_and_until_a_replay_is_measured_only_a_held_bucket_replays():
    choice = ReplayOrEager()
    assert choice.pads("train", 100, 110, held=False)
    assert not choice.pads("train", 100, 120, held=False)  # another capture would not be measured either
    assert choice.pads("train", 100, 110, held=True)
    assert choice.pads("score", 100, 110, held=False)  # each mode learns on its own


def test_the_way_measured_faster_runs_and_the_other_is_tried_again_after_doubling_waits():
    choice = _learnt(replay_rate=1.0, eager_rate=2.0)  # the host is the bound: eager is twice as slow
    ways = [choice.pads("score", 100, 110, held=True) for _ in range(130)]
    eager_calls = [i + 1 for i, replays in enumerate(ways) if not replays]
    assert eager_calls == [9, 26, 59, 124]  # after 8, 16, 32 and 64 replays


def test_where_eager_is_faster_a_held_bucket_is_still_retried_but_an_unheld_one_never_captures():
    choice = _learnt(replay_rate=1.3, eager_rate=1.0)  # padding costs more than the launches
    unheld = [choice.pads("score", 100, 110, held=False) for _ in range(40)]
    assert not any(unheld)
    held = [choice.pads("score", 100, 110, held=True) for _ in range(9)]
    assert held == [True] + [False] * 8  # waited since the last replay: tried once, then eager again


def test_a_bucket_not_held_captures_once_the_eager_calls_have_lost_a_captures_worth():
    choice = _learnt(replay_rate=1.0, eager_rate=1.5)  # replays would save 50 ms a call of 100 units
    ways = [choice.pads("score", 100, 100, held=False) for _ in range(10)]
    # a capture costs capture_steps (4) replays, 400 ms: the eighth call has lost 400 ms, and captures
    assert ways == [False] * 7 + [True] + [False] * 2


def test_the_rate_is_the_median_of_the_last_measured_calls_after_the_first():
    choice = _learnt(replay_rate=1.0, eager_rate=2.0)
    choice.harvest()
    assert choice.rates == {("score", REPLAY): 1.0, ("score", EAGER): 2.0}  # the first 1e4 ms calls left out
    for rate in (3.0, 50.0, 2.5, 2.2, 2.4, 2.6, 2.3, 2.1):  # one outlier; the window holds the last 8
        _measure(choice, "score", EAGER, 50, 50 * rate)
    choice.harvest()
    assert choice.rates[("score", EAGER)] == pytest.approx(2.45)  # 2.0 has left the window
    assert choice.predicted_ms("score", EAGER, 100) == pytest.approx(245)  # one size: the time per unit of work


def test_an_eager_calls_launches_are_a_fixed_part_so_small_layouts_replay_and_large_ones_run_eagerly():
    # host-bound eager calls: 40 ms of launches plus 0.01 ms a unit; replays 0.03 ms a unit of their bucket (10 % more)
    choice = _learnt(replay_rate=0.03, eager_rate=0.41)
    for work in (1000, 2000, 1500, 3000, 2500, 1200, 2800):
        _measure(choice, "score", EAGER, work, 40 + 0.01 * work)
        _measure(choice, "score", REPLAY, 1.1 * work, 0.03 * 1.1 * work)
    choice.harvest()
    fit = choice.call_time("score", EAGER)
    assert (fit.fixed, fit.per_unit) == (pytest.approx(40), pytest.approx(0.01))
    # a time per unit of work alone (about 0.027 here) would call eager dearer than a replay at 6000 units
    assert choice.predicted_ms("score", EAGER, 6000) < choice.predicted_ms("score", REPLAY, 6600)
    assert choice.pads("score", 6000, 6600, held=True)  # no replay measured near 6600: tried there once
    _measure(choice, "score", REPLAY, 6600, 0.03 * 6600)
    assert not choice.pads("score", 6000, 6600, held=True)
    assert choice.pads("score", 800, 880, held=True)  # (within `reach` of the measured works: no trial there)


def test_a_way_is_tried_where_its_calls_have_not_reached_and_then_chosen_by_its_own_time_there():
    """Two sizes of layout: the large one's bucket held, the small ones eager (their bucket not held). Eager's samples
    are all small, so its time per unit (host launches spread over few rows) prices a large eager call dearer than its
    replay, and the small ones' eager calls keep resetting eager's wait: without trying eager where no eager call
    reaches, the large layouts replay for ever though eager is faster there."""
    def eager(w):
        return 5.4 + 0.0028 * w  # the ninth session's fit on the H200, 8 layers

    def replay(b):
        return 0.0035 * b

    choice = ReplayOrEager()
    assert choice.pads("score", 7000, 8000, held=False)  # the large layout captures first
    for ms in (1e4, replay(8000)):
        assert choice.pads("score", 7000, 8000, held=True)
        _measure(choice, "score", REPLAY, 8000, ms)
    for ms in (1e4, eager(2000), eager(2100), eager(1900)):
        assert not choice.pads("score", 2000, 2300, held=False)
        _measure(choice, "score", EAGER, 2000, ms)
    choice.harvest()
    assert choice.predicted_ms("score", EAGER, 7000) > choice.predicted_ms("score", REPLAY, 8000)  # carried over
    assert not choice.pads("score", 7000, 8000, held=True)  # tried where no eager call reaches
    pending = choice.timing("score", EAGER, 7000, torch.device("cpu"))  # still on the device
    assert choice.pads("score", 7100, 8000, held=True)  # a call being measured there reaches: not tried twice
    pending.phases.append(Phase(0.0, None, eager(7000) / 1e3))
    assert not choice.pads("score", 7000, 8000, held=True)  # now its own time there decides: eager
    assert choice.pads("score", 2000, 2300, held=True)  # and the small layouts, their bucket now held, replay


def test_one_stalled_call_moves_neither_part_of_the_fit():
    calls = [(w, 40 + 0.01 * w) for w in (1000, 1400, 1800, 2200, 2600, 3000, 3400)] + [(2000, 400.0)]
    fit = fit_call_time(calls)
    assert (fit.fixed, fit.per_unit) == (pytest.approx(40), pytest.approx(0.01))


def test_works_too_close_to_tell_the_parts_apart_give_the_median_time_per_unit():
    calls = [(1000, 30.0), (1050, 33.0), (1100, 31.0), (1020, 32.0)]
    fit = fit_call_time(calls)
    assert fit.fixed == 0 and fit.per_unit == pytest.approx(statistics.median(ms / w for w, ms in calls))


def test_a_training_forward_whose_backward_never_runs_is_forgotten():
    choice = ReplayOrEager(keep=4)
    timing = choice.timing("train", EAGER, 10, torch.device("cpu"))
    timing.expected = 2
    timing.begin()
    timing.end()
    for _ in range(4):
        _measure(choice, "train", REPLAY, 10, 10)
    assert timing not in choice.pending and len(choice.pending) == 4


class Fixed(ReplayOrEager):
    """Measured times as set: `rates` ms per unit of work, whatever the host clock says."""

    def __init__(self, replay_rate, eager_rate):
        super().__init__()
        self.fixed = {REPLAY: replay_rate, EAGER: eager_rate}

    def measured_ms(self, timing):
        return self.fixed[timing.way] * timing.work


def _models(choice=None):
    plain = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    graphed = tiny.build(
        "qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_cuda_graphs=True,
        shared_prefix_cuda_graphs_training="auto", shared_prefix_cuda_graphs_scoring="auto",
    )
    graphs = layer_graphs.LayerGraphs(4, replay=EagerReplay)
    if choice is not None:
        graphs.choice = choice
    layer_graphs.use_graphs(graphed.model, graphs)
    return plain, graphed, graphs


def _step(net, seed, train):
    """Loss and gradients (training) or logits (scoring) of one GRPO micro-batch, and its plan."""
    ids, cu, prompt = tiny.grpo_batch([(70, [5, 9, 3])], seed=seed)
    plans = []
    net.zero_grad(set_to_none=True)
    with shared_prefix.observe_plans(lambda plan, tokens: plans.append(plan)), torch.set_grad_enabled(train):
        out = net(input_ids=ids, labels=ids.masked_fill(prompt, -100) if train else None, **tiny.packed_kwargs(cu))
        if train:
            out.loss.backward()
            return (out.loss.detach(), tiny.grads(net)), plans[0]
    return out.logits, plans[0]


@pytest.mark.parametrize("train", [True, False], ids=["training", "scoring"])
@pytest.mark.parametrize("rates", [(1.0, 2.0), (1.3, 1.0)], ids=["replays-faster", "eager-faster"])
def test_either_way_a_call_gives_the_numbers_of_the_model_without_graphs(train, rates):
    plain, graphed, graphs = _models(Fixed(*rates))
    ways = []
    for seed in range(1, 13):
        want, _ = _step(plain, seed, train)
        got, plan = _step(graphed, seed, train)
        ways.append(EAGER if plan.eager else REPLAY)
        assert (plan.bucket is None) == plan.eager  # padded exactly when it replays
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    mode = "train" if train else "score"
    faster = REPLAY if rates[0] < rates[1] else EAGER
    # a capture, two replays and two eager calls (the first of each left out), then the faster way (the other
    # tried again once 8 calls have passed since it last ran)
    assert ways[:5] == [REPLAY, REPLAY, REPLAY, EAGER, EAGER] and ways[5:].count(faster) >= 6, ways
    assert graphs.stats.eager == ways.count(EAGER)
    assert set(graphs.choice.rates) == {(mode, REPLAY), (mode, EAGER)}


def test_on_the_cpu_both_ways_are_measured_by_the_host_clock_in_both_modes():
    _, graphed, graphs = _models()
    for seed in range(1, 6):  # a capture, two replays, two eager calls
        _step(graphed, seed, True)
        _step(graphed, seed, False)
    graphs.choice.harvest()
    assert set(graphs.choice.rates) == {(m, w) for m in ("train", "score") for w in (REPLAY, EAGER)}
    assert all(rate > 0 for rate in graphs.choice.rates.values())
    assert "train replay" in graphs.choice.describe()


def test_layouts_that_outgrew_the_first_capture_capture_again_after_a_wait():
    """No replay measured yet and no held bucket fits (longer rollouts than the first call's): eager for
    `explore_after` calls, then a capture, so that a replay can be measured at all."""
    choice = ReplayOrEager()
    assert choice.pads("train", 100, 110, held=False)  # the first capture
    for ms in (1e4, 200.0):
        assert not choice.pads("train", 300, 330, held=False)
        _measure(choice, "train", EAGER, 300, ms)
    ways = [choice.pads("train", 300, 330, held=False) for _ in range(9)]
    assert ways == [False] * 6 + [True] + [False] * 2  # 8 eager calls since the capture, then one capture


def test_under_auto_a_scoring_forwards_plan_is_reused_by_the_training_forward_of_the_batch():
    from patchgen.kernels.shared_prefix.plan_reuse import PLANS

    _, graphed, _ = _models()
    graphed.config.shared_prefix_plan_reuse = True
    PLANS.clear()
    hits = PLANS.hits
    _, scored_plan = _step(graphed, 7, False)
    _, trained_plan = _step(graphed, 7, True)
    assert PLANS.hits == hits + 1 and trained_plan is scored_plan


def test_training_eager_never_graphs_a_step_so_checkpointing_is_not_refused():
    plain = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    graphed = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_cuda_graphs=True,
                         shared_prefix_cuda_graphs_training="eager")
    graphs = layer_graphs.LayerGraphs(2, replay=EagerReplay)
    layer_graphs.use_graphs(graphed.model, graphs)
    for net in (plain, graphed):
        net.activation_checkpointing_enable()
    want, _ = _step(plain, 3, True)
    got, plan = _step(graphed, 3, True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert plan.bucket is None and graphs.stats.eager == 1 and graphs.stats.captures == 0


def test_a_scoring_graph_captured_under_no_grad_is_not_a_held_bucket_for_inference_mode():
    """The two hold different tensors (inference ones cannot be written under no_grad) and key apart: a plan priced as
    a replay of a held bucket must be one its own kind of call can replay, not a capture in disguise."""
    _, graphed, graphs = _models()
    _step(graphed, 1, train=False)  # the first scoring call captures, under no_grad
    with torch.no_grad():
        assert len(graphs.held_buckets(training=False)) == 1
    with torch.inference_mode():
        assert graphs.held_buckets(training=False) == ()
    assert graphs.held_buckets(training=True) == ()


def test_a_way_tried_at_every_work_once_then_waits_though_its_window_no_longer_holds_them():
    """Layouts of twelve sizes, replays far faster at all: after eager has been tried at each size, it waits the
    doubling waits. Its window of eight calls cannot hold twelve sizes, cycled: trying it wherever the window did not
    reach ran every call eagerly for ever, each about 20 times a replay's time."""
    choice = _learnt(replay_rate=0.01, eager_rate=2.01)
    works = [1000 * 1.3**k for k in range(12)]
    ways = []
    for work in works * 20:
        replays = choice.pads("score", work, 1.1 * work, held=True)
        way = REPLAY if replays else EAGER
        _measure(choice, "score", way, 1.1 * work if replays else work, 0.011 * work if replays else 200 + 0.01 * work)
        ways.append(way)
    assert ways[:120].count(EAGER) <= len(works) + 4  # a trial at each size, and the waits of 8, 16, 32, 64 calls
    assert ways[120:].count(EAGER) <= 2
