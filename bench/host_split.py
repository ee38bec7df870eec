"""Where a loop's host time goes, by the clock and without a profiler: per forward, the host ms inside each phase of
`pass_timeline.phases` and each decoder layer by what it did (run eagerly, captured, replayed, run as it is), with the
parts of a replay (the walk of the layer's modules, the statics' copy, the tape's graphs and linears).

The profiler's records cost the host more than the work they time (a 32-layer scoring forward's host time 44 ms
under it against 50 ms of a loop's queueing, which includes the waits), so the timers here are `perf_counter` pairs
around the same functions: about a us per call. The times are inclusive (a replay's walk is inside the replay) and
host-side only: a function that waits for the device counts the wait.

Used by `scoring_loop.py --host-split`."""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections import defaultdict

from pass_timeline import wrapped

# the parts of a layer graph's replay (inclusive, inside "layer: replayed")
REPLAY_PARTS = (
    ("patchgen.kernels.modeling.scoring_layers", "_walk", "replay part: walk of the layer's modules"),
    ("patchgen.kernels.modeling.scoring_layers", "_split_kwargs", "replay part: keyword split"),
    ("patchgen.kernels.shared_prefix.call_graphs", "_copy_in", "replay part: statics' copy"),
    ("patchgen.kernels.shared_prefix.graph_tape", "Tape.replay", "replay part: tape (graphs and linears)"),
    ("patchgen.kernels.shared_prefix.graph_tape", "Tape.record", "capture part: the tape's recording"),
    # each decoder layer's call, labelled by what the layer graphs did in it (`_layer_timed`)
    ("patchgen.kernels.modeling.scoring_layers", "_replayed", LAYER := "layer"),
)


# the parts of a plan's build (inclusive, inside "plan"): which of them takes the host's time, where the plan took 2 ms
# a forward on one H200 host and 8 on another for the same shape (docs/bench, thirteenth session)
PLAN_PARTS = (
    ("patchgen.kernels.modeling.shared_prefix", "build_plan", "plan part: built (not reused)"),
    ("patchgen.kernels.shared_prefix.plan", "find_tree", "plan part: prefix tree"),
    ("patchgen.kernels.shared_prefix.plan", "_arena", "plan part: pinned arena"),
    ("patchgen.kernels.shared_prefix.plan", "build_layout", "plan part: layout"),
    ("patchgen.kernels.shared_prefix.plan", "gdn_host_index", "plan part: GDN arrays"),
    ("patchgen.kernels.shared_prefix.plan", "attention_host_index", "plan part: attention arrays"),
    ("patchgen.kernels.shared_prefix.plan", "conv_host_index", "plan part: conv arrays"),
    ("patchgen.kernels.shared_prefix.plan", "lm_host_index", "plan part: LM rows"),
    ("patchgen.kernels.shared_prefix.plan", "_upload", "plan part: upload"),
    ("patchgen.kernels.shared_prefix.plan", "conv_index", "plan part: conv index (its look-back tables)"),
    # outside the build, inside "plan" (0.4 ms on one host, 2.7 on another, fourteenth session)
    ("patchgen.kernels.modeling.shared_prefix", "build_or_reuse", "plan part: build or reuse"),
    ("patchgen.kernels.shared_prefix.plan_reuse", "_to_host", "plan part: reuse's host copy"),
    ("patchgen.kernels.shared_prefix.plan_reuse", "resolve_level_cost", "plan part: reuse's level cost"),
    ("patchgen.kernels.shared_prefix.plan_reuse", "PlanReuse.find", "plan part: reuse's lookup"),
    ("patchgen.kernels.shared_prefix.plan_reuse", "PlanReuse.keep", "plan part: reuse's keep"),
    ("patchgen.kernels.modeling.shared_prefix", "working", "plan part: working backends (for errors)"),
    ("patchgen.kernels.modeling.shared_prefix", "check_gdn_backend", "plan part: backend checks"),
    ("patchgen.kernels.modeling.shared_prefix", "check_conv_backend", "plan part: backend checks"),
    ("patchgen.kernels.modeling.shared_prefix", "check_attention_backend", "plan part: backend checks"),
)
GC_PAUSES = "gc pauses (anywhere in the forward)"


class Split:
    """Inclusive host ms and calls per label, over the forwards counted."""

    def __init__(self):
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.forwards = 0

    def add(self, label: str, seconds: float) -> None:
        self.ms[label] += seconds * 1e3
        self.calls[label] += 1

    def report(self, title: str) -> str:
        n = max(self.forwards, 1)
        lines = [f"--- {title}: host ms per forward by the clock (inclusive; {self.forwards} forwards)",
                 "   ms/fwd  calls/fwd  us/call  label"]
        for label, ms in sorted(self.ms.items(), key=lambda kv: -kv[1]):
            calls = self.calls[label]
            lines.append(f"  {ms / n:7.2f}  {calls / n:9.1f}  {ms * 1e3 / max(calls, 1):7.1f}  {label}")
        return "\n".join(lines)


def _timed(fn, label: str, split: Split):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            split.add(label, time.perf_counter() - began)

    return wrapper


def _layer_timed(fn, split: Split):
    """A decoder layer's call, labelled by what the layer graphs did in it (their counters before and after)."""
    from patchgen.kernels.shared_prefix.call_graphs import LAYER_GRAPHS

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        captures, replays = LAYER_GRAPHS.captures, LAYER_GRAPHS.replays
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - began
            kind = ("captured and replayed" if LAYER_GRAPHS.captures > captures
                    else "replayed" if LAYER_GRAPHS.replays > replays else "eager (first of a kind, or as it is)")
            split.add(f"layer: {kind}", took)

    return wrapper


@contextlib.contextmanager
def host_split(module):
    """Time the generated `module`'s forwards while the block runs (restored after); yields the `Split`."""
    split = Split()

    def wrap(fn, label):
        return _layer_timed(fn, split) if label == LAYER else _timed(fn, label, split)

    began = []

    def collecting(phase, info):  # the collector's pauses, wherever they fall: a plan's many small objects may start one
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            split.add(GC_PAUSES, time.perf_counter() - began.pop())

    gc.callbacks.append(collecting)
    try:
        with wrapped(module, wrap, REPLAY_PARTS + PLAN_PARTS):
            yield split
    finally:
        gc.callbacks.remove(collecting)
        split.forwards = split.calls.get("model", 0)


# what `profiled` can profile: (module, attribute path) of the function, and why one would
PROFILED = {
    # the plan's host time beyond the parts `PLAN_PARTS` names (0.6-1.5 ms a forward outside its build on the
    # fourteenth session's last host: torch's CPU searchsorted)
    "plan": ("patchgen.kernels.modeling.shared_prefix", "plan_for"),
    # a layer graph's capture: the layer's Python under capture against the graphs' begin, end and instantiation
    "capture": ("patchgen.kernels.shared_prefix.graph_tape", "Tape.record"),
    # a replay's tape: its graph launches against its linears' `mm`s
    "replay": ("patchgen.kernels.shared_prefix.graph_tape", "Tape.replay"),
    # a whole decoder layer's call under the layer graphs (walk, key, copies, tape, clone)
    "layer": ("patchgen.kernels.modeling.scoring_layers", "_replayed"),
}


@contextlib.contextmanager
def profiled(what: str):
    """cProfile inside every call of the function `PROFILED[what]` names and nothing else while the block runs.
    Yields a callable that renders the profile's top functions by their own time, per call of that function."""
    import cProfile
    import importlib
    import io
    import pstats

    module_name, path = PROFILED[what]
    owner = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    real = owner.__dict__[name]
    profile, calls = cProfile.Profile(), []

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        calls.append(1)
        profile.enable()
        try:
            return real(*args, **kwargs)
        finally:
            profile.disable()

    def report(top: int = 30) -> str:
        if not calls:  # pstats refuses an empty profile
            return f"--- {path} under cProfile: no call in the loop"
        stats = pstats.Stats(profile, stream=io.StringIO()).stats  # (file, line, name) -> (cc, calls, own s, cum s, _)
        n_calls = len(calls)
        title = f"--- {path} under cProfile ({n_calls} calls; its own overhead inflates small calls): per call, by own time"
        lines = [title, "  own us    cum us  calls/call  function"]
        for (file, line, fn), (_, n, own, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
            where = f"{file.rsplit('/', 2)[-2]}/{file.rsplit('/', 1)[-1]}:{line}" if "/" in file else file
            lines.append(f"  {own * 1e6 / n_calls:6.1f}  {cum * 1e6 / n_calls:8.1f}  {n / n_calls:10.1f}  {fn} ({where})")
        return "\n".join(lines)

    setattr(owner, name, wrapper)
    try:
        yield report
    finally:
        setattr(owner, name, real)
