"""Replay or run eagerly, call by call, by the time each way has taken (``"auto"`` in
``shared_prefix_cuda_graphs_training`` and ``shared_prefix_cuda_graphs_scoring``).

A replay launches the whole layer stack at once on a plan padded to a bucket (`shared_prefix/bucket.py`): the
host is nearly free, the device does the bucket's work. An eager call runs the layout's own, unpadded plan, and
the host launches every kernel. Which is faster depends on the shape: on the H200 at 8 layers, n=4 P=2048 rows
keep the device busy for less time than the host takes to launch an eager stack (replays win), n=8 P=4096 rows
for more, and there the bucket's padding costs more than the launches (eager wins, in training steps and in
scoring forwards alike; docs/cuda_graphs.md, "Replay or eager"). No fixed rule tells the two apart on another
device, width or length, so each model measures.

What is measured: per mode (training steps, scoring forwards) and way, the time of the layer stack against its plan's
work (`bucket.cost`: the bucket's for a replay, the layout's own for an eager call). A call's time is, per
phase (the forward; a training step's backward too), the device's time between CUDA events recorded around it, read
once the device has passed them (no sync). That interval is what the call adds to a loop's wall time either way:
where the host is the bound the device waits inside it for the launches, and where the device is, the host's head
start is hidden, as it is in the loop. The host's own clock is not used on CUDA: a host that runs ahead of a busy
device blocks on the launch queue, and would charge the call with the earlier calls' device time. The last `window` calls count,
and each way's first measured call per mode is left out (first-use compiles and autotuning). Calls that capture are
not measured (a capture is not a replay). Off CUDA the host clock is the time.

How a time is predicted (`CallTime`): a fixed part plus a part per unit of work. An eager call's launches cost about
the same whatever its rows, so where the host is the bound a small layout's eager call costs nearly what a large
one's does; a time per unit of work alone would carry a large layout's rate to a small one and call eager cheap
there (and the reverse). The two parts are a Theil-Sen fit (the median of the slopes between pairs of calls, then
the median of what is left): one stalled call among the window moves neither. Where the window's works lie too
close together to tell the parts apart (RL's micro-batches of one shape), the time is the median time per unit.

How a call is decided (`ReplayOrEager.pads`): the first call of a mode replays (a capture: the replay's time is
learnt first, because where the host is the bound a replay is the only fast way), and until a replay has been
measured the others replay only a held bucket; then calls run eagerly until an eager call is measured; from then
on the way predicted faster for this layout's work. A layout whose bucket is not held would capture: it runs
eagerly while eager is predicted faster, and otherwise too until the time eager calls lost to the predicted replays
adds up to a capture's cost (about `capture_steps` replays, rent or buy), then captures. The losing way runs again
after `explore_after` calls, then after twice as many each time it still loses (the times drift: other layouts,
a warmer host), and at once at a work none of its measured calls lies within `reach` of: there its time would be
carried over from other works (layouts of two sizes, the small ones eager while their bucket is not held, would
otherwise price eager for the large ones by the small ones' time per unit, and never try it there, since the small
ones' eager calls keep resetting the wait). A replay is only ever explored on a held bucket.

The eager and the replayed stack run the same kernels on the same real rows, and the padding rows are read by no
real row; but a GEMM or reduction over more rows may round differently (float32 logits 3e-8 apart on the CPU; bit-equal
in every H200 run so far), and which way a call takes depends on measured times: for runs reproducible bit for bit,
set ``"graphs"`` or ``"eager"``. A plan kept by `plan_reuse` keeps the way chosen when it was built. The backward
phase runs from the stack output's backward to its input's (to the end of the backward pass when the input wants no
gradient: frozen embeddings). Known limits: a frozen model scored with gradients on is planned under the training
gate but runs as a scoring call; with ``shared_prefix_cuda_graphs_buckets=False`` nothing is padded and "auto" replays as "graphs".
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

REPLAY, EAGER = "replay", "eager"
MODES = ("train", "score")


@dataclass(frozen=True)
class CallTime:
    """A predicted call time: `fixed` ms a call plus `per_unit` ms per unit of the plan's work."""

    fixed: float
    per_unit: float

    def ms(self, work: float) -> float:
        return self.fixed + self.per_unit * work


def fit_call_time(calls: Sequence[tuple[float, float]], spread: float = 1.25, distinct: float = 1.05) -> CallTime:
    """The call time of measured `(work, ms)` calls: a robust line where their works span `spread` or more, else the
    median time per unit of work (see the module docstring).

    Slopes come from the pairs whose works differ by `distinct` or more (closer pairs' slopes are noise); a line with
    a negative part (the noise of a narrow window) gives way to the time per unit of work."""
    proportional = CallTime(0.0, statistics.median(ms / work for work, ms in calls))
    works = [work for work, _ in calls]
    if len(calls) < 3 or max(works) < spread * min(works):
        return proportional
    slopes = [(m1 - m0) / (w1 - w0) for (w0, m0), (w1, m1) in itertools.combinations(sorted(calls), 2)
              if w1 >= distinct * w0]
    if len(slopes) < 3:
        return proportional
    per_unit = statistics.median(slopes)
    fixed = statistics.median(ms - per_unit * work for work, ms in calls)
    if per_unit < 0 or fixed < 0:
        return proportional
    return CallTime(fixed, per_unit)


@dataclass
class Phase:
    """The host's and the device's start and end of one phase of a measured call."""

    host_start: float
    event_start: torch.cuda.Event | None
    host_end: float | None = None
    event_end: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self.host_end is not None and (self.event_end is None or self.event_end.query())

    def ms(self) -> float:
        if self.event_start is None:  # off CUDA the host runs the kernels: its clock is the time
            return (self.host_end - self.host_start) * 1e3
        return self.event_start.elapsed_time(self.event_end)


@dataclass
class Timing:
    """One measured call of the layer stack: its mode, its way, its plan's work and its phases."""

    mode: str
    way: str
    work: float
    device: torch.device
    phases: list[Phase] = field(default_factory=list)
    expected: int = 1  # phases it will have: 2 for a training step (forward and backward)
    ends_at_input: bool = False  # the backward phase ends at the stack input's backward (`mark_backward_end`)

    def begin(self, stream=None) -> None:
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        self.phases.append(Phase(time.perf_counter(), event))

    def end(self, stream=None) -> None:
        phase = self.phases[-1]
        if phase.event_start is not None:
            phase.event_end = torch.cuda.Event(enable_timing=True)
            phase.event_end.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        phase.host_end = time.perf_counter()

    def done(self) -> bool:
        return len(self.phases) == self.expected and all(p.done() for p in self.phases)


def _stream(tensor: torch.Tensor):
    return torch.cuda.current_stream(tensor.device) if tensor.device.type == "cuda" else None


class _BackwardStart(torch.autograd.Function):
    """Identity on the stack's output: its backward starts the timing's backward phase. Without a stack input that
    wants a gradient (frozen embeddings) a callback at the end of the backward pass ends it (later, by the embedding's
    backward and whatever else the pass holds)."""

    @staticmethod
    def forward(ctx, out, timing, end_at_pass_end):
        ctx.timing, ctx.end_at_pass_end = timing, end_at_pass_end
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        timing, stream = ctx.timing, _stream(grad)
        timing.begin(stream)
        if ctx.end_at_pass_end:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_quietly(timing, stream))
        return grad, None, None


class _BackwardEnd(torch.autograd.Function):
    """Identity on the stack's input: its backward, the stack's last, ends the timing's backward phase."""

    @staticmethod
    def forward(ctx, hidden, timing):
        ctx.timing = timing
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        if ctx.timing.phases and ctx.timing.phases[-1].host_end is None:
            ctx.timing.end(_stream(grad))
        return grad, None


def _end_quietly(timing: Timing, stream) -> None:
    # an exception in an end-of-backward callback on a device thread aborts the process: a lost sample is better
    try:
        timing.end(stream)
    except Exception:  # noqa: BLE001
        timing.expected = -1  # never done: forgotten with the oldest pending


def mark_backward_end(hidden: torch.Tensor, timing: Timing | None) -> torch.Tensor:
    """The stack's input, marked so that a training step's backward phase ends where the stack's backward does."""
    if timing is None or not hidden.requires_grad:
        return hidden
    timing.ends_at_input = True
    return _BackwardEnd.apply(hidden, timing)


def time_backward(out: torch.Tensor, timing: Timing | None) -> torch.Tensor:
    """`out`, with the backward phase of a training step's `timing` measured when its backward runs."""
    if timing is None or not out.requires_grad:
        return out
    timing.expected = 2
    return _BackwardStart.apply(out, timing, not timing.ends_at_input)


class Gate:
    """What `build_plan` asks whether to pad a layout to its bucket (`bucket.padded_host`); one per mode and
    chooser, so that equal plans built under it compare equal in `plan_reuse`'s key."""

    def __init__(self, choice: ReplayOrEager, mode: str):
        self.choice, self.mode = choice, mode

    def __call__(self, own_work: float, bucket_work: float, held: bool) -> bool:
        return self.choice.pads(self.mode, own_work, bucket_work, held)


class ReplayOrEager:
    """Per mode, replay or eager for each call, by the times measured so far (see the module docstring)."""

    def __init__(self, explore_after: int = 8, explore_cap: int = 256, window: int = 8, skip_first: int = 1,
                 capture_steps: float = 4.0, keep: int = 32, reach: float = 1.25):
        self.explore_after, self.explore_cap, self.reach = explore_after, explore_cap, reach
        self.window, self.skip_first, self.capture_steps, self.keep = window, skip_first, capture_steps, keep
        self.samples: dict[tuple[str, str], deque] = {}  # (mode, way) -> the last measured calls' (work, ms)
        # (mode, way) -> works measured, kept past the window (`reaches`): each out of `reach` of the others, so few
        self.reached: dict[tuple[str, str], list[float]] = {}
        self._fits: dict[tuple[str, str], CallTime] = {}  # (mode, way) -> the fit of its samples (dropped on a new one)
        self.skipped: dict[tuple[str, str], int] = {}
        self.waited: dict[tuple[str, str], int] = {}  # calls since the way last ran
        self.interval: dict[tuple[str, str], int] = {}  # calls the losing way waits before it runs again
        self.owed: dict[str, float] = {}  # ms eager calls lost to replays of buckets not held (rent)
        self.best: dict[str, str] = {}
        self.pending: list[Timing] = []
        self.decided: dict[tuple[str, str], int] = {}  # calls run each way (for reports and tests)
        self._gates = {mode: Gate(self, mode) for mode in MODES}

    def gate(self, mode: str) -> Gate:
        return self._gates[mode]

    def timing(self, mode: str, way: str, work: float | None, device: torch.device) -> Timing | None:
        """A timing to fill for one call (None without a work figure: nothing to compare it with)."""
        if work is None or work <= 0:
            return None
        timing = Timing(mode, way, float(work), torch.device(device))
        self.pending.append(timing)
        del self.pending[: -self.keep]  # a training forward whose backward never ran is never done: forgotten
        return timing

    def measured_ms(self, timing: Timing) -> float:
        return sum(phase.ms() for phase in timing.phases)

    def harvest(self) -> None:
        """Fold the finished timings into the rates (the device has passed their events: no wait)."""
        still = []
        for timing in self.pending:
            if not timing.done():
                still.append(timing)
                continue
            key = (timing.mode, timing.way)
            if self.skipped.get(key, 0) < self.skip_first:
                self.skipped[key] = self.skipped.get(key, 0) + 1
                continue
            self.samples.setdefault(key, deque(maxlen=self.window)).append((timing.work, self.measured_ms(timing)))
            self._fits.pop(key, None)
            if not self._within_reach(timing.work, self.reached.get(key, ())):
                self.reached.setdefault(key, []).append(timing.work)
        self.pending = still

    @property
    def rates(self) -> dict[tuple[str, str], float]:
        """(mode, way) -> ms per unit of work: the median over the last `window` measured calls (for reports)."""
        return {key: statistics.median(ms / work for work, ms in calls) for key, calls in self.samples.items() if calls}

    def call_time(self, mode: str, way: str) -> CallTime | None:
        """The fitted time of a call of `mode` run `way` (None before one has been measured)."""
        key = (mode, way)
        if key not in self._fits and self.samples.get(key):
            self._fits[key] = fit_call_time(self.samples[key])
        return self._fits.get(key)

    def predicted_ms(self, mode: str, way: str, work: float) -> float | None:
        fit = self.call_time(mode, way)
        return None if fit is None else fit.ms(work)

    def pads(self, mode: str, own_work: float, bucket_work: float, held: bool) -> bool:
        """Whether a call of `mode` replays on its bucket (True: pad the plan) or runs eagerly on its own plan."""
        self.harvest()
        replay, eager = self.predicted_ms(mode, REPLAY, bucket_work), self.predicted_ms(mode, EAGER, own_work)
        if replay is None:
            # the first call captures; until a replay is measured others replay a held bucket, and capture one not held
            # once `explore_after` calls have run eagerly (the layouts may have outgrown the first capture's bucket)
            waited = self.waited.get((mode, REPLAY), 0)
            first = not self.decided.get((mode, REPLAY))
            return self._run(mode, REPLAY if held or first or waited >= self.explore_after else EAGER)
        if eager is None:
            return self._run(mode, EAGER)
        if held or eager <= replay:
            best = REPLAY if replay < eager else EAGER
        else:  # a capture: rent (eager) until what the replays would have saved pays for it
            self.owed[mode] = self.owed.get(mode, 0.0) + eager - replay
            best = REPLAY if self.owed[mode] >= self.capture_steps * replay else EAGER
        if best == REPLAY and not held:
            self.owed[mode] = 0.0
        other = EAGER if best == REPLAY else REPLAY
        if self.best.get(mode) != best:  # the loser starts waiting anew
            self.best[mode] = best
            self.interval[(mode, other)] = self.explore_after
        if other == EAGER or held:
            if self.waited.get((mode, other), 0) >= self.interval[(mode, other)]:
                self.interval[(mode, other)] = min(2 * self.interval[(mode, other)], self.explore_cap)
                return self._run(mode, other)
            if not self.reaches(mode, other, bucket_work if other == REPLAY else own_work):
                return self._run(mode, other)  # its time here would be a guess: learn it
        return self._run(mode, best)

    def reaches(self, mode: str, way: str, work: float) -> bool:
        """Whether a call of `work` lies within `reach` of a call measured (or being measured) that way: if not, the
        prediction there is carried from other works (a rate learnt on small layouts put on a large one). Measured
        ever, not only in the window: a way run at more works than its window holds pushes its calls at some out,
        and a trial each time they were (twelve sizes cycling through a window of eight) ran every call that way for
        ever; once measured there, the doubling waits retry it."""
        works = [*self.reached.get((mode, way), ())]
        works += [t.work for t in self.pending if (t.mode, t.way) == (mode, way)]
        return self._within_reach(work, works)

    def _within_reach(self, work: float, works) -> bool:
        return any(w <= self.reach * work and work <= self.reach * w for w in works)

    def _run(self, mode: str, way: str) -> bool:
        other = EAGER if way == REPLAY else REPLAY
        self.waited[(mode, way)] = 0
        self.waited[(mode, other)] = self.waited.get((mode, other), 0) + 1
        self.decided[(mode, way)] = self.decided.get((mode, way), 0) + 1
        return way == REPLAY

    def describe(self) -> str:
        fits = {key: self.call_time(*key) for key in self.samples if self.samples[key]}
        rates = ", ".join(f"{m} {w} {f.fixed:.3g} ms + {f.per_unit:.4g} ms/unit" for (m, w), f in sorted(fits.items()))
        calls = ", ".join(f"{m} {w} {n}" for (m, w), n in sorted(self.decided.items()))
        return f"replay or eager: rates {rates or 'none yet'}; calls {calls or 'none'}"
