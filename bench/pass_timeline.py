"""Where a pass leaves the GPU idle: the host phases of one call, and the device's idle gaps against them.

Used by `profile_shared_prefix.py --timeline` and `scoring_loop.py --timeline`. `phases(module)` wraps the
functions a forward of the generated module runs through (the top model, the host rows' upload, the verification
check, the packed row's boundaries, the positions, the op table, plan building, the text model, the layer stack,
the graph key, the static load, the scoring replay, the LM head) in `torch.profiler.record_function` ranges for as
long as the block runs; the models' code is not changed (the op table is looked up once per layer as well: a few
microseconds of host time more per layer while profiled). `timeline(events)` reads one profiled call's records
(`shared_prefix_timing.events_of`) and says, from the call's start:

- each phase's host start and duration (its first call's; a phase called again is counted in `calls`);
- the device's busy time (union of kernels, copies, memsets), and every idle gap of at least `min_gap_us`,
  with the innermost phase the host was in and the CUDA call it was making when the gap began: a gap at the
  start of the call is the host building what the first kernel needs; a gap that begins inside a
  synchronize call is the host waiting for the device and then launching what comes after.

Wall minus busy is what a faster host (or one overlapping its work with the device's) could win.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

# (where the name is looked up, the name, the label) in call order; the generated module's names come first
GENERATED = (
    ("Qwen3_5ForCausalLM.forward", "model"), ("Qwen3_5TextModel.forward", "text model"), ("causal_lm_head", "LM head"),
    ("resolve_packed", "packed row"),
)
KERNELS = (
    ("patchgen.kernels.modeling.host_rows", "upload", "host rows"),
    ("patchgen.kernels.modeling.verify", "due", "verify due"),
    ("patchgen.kernels.modeling.shared_prefix", "packed_positions", "positions"),
    ("patchgen.kernels.ops", "of", "op table"),
    ("patchgen.kernels.modeling.shared_prefix", "plan_for", "plan"),
    ("patchgen.kernels.modeling.layer_graphs", "run_layers", "layer stack"),
    ("patchgen.kernels.modeling.layer_graphs", "call_signature", "graph key"),
    ("patchgen.kernels.modeling.layer_graphs", "replay_scoring", "scoring replay"),
    ("patchgen.kernels.graphs.static", "StaticCall.load", "static load"),
)
_IGNORED = {"gpu_user_annotation", "python_function", "overhead"}


def device_kind(event) -> str:
    """A device record's kind: the profiler's own, or, where this torch's records carry none (the H200 image's
    torch 2.11), read off its name as the runtime writes it ("Memcpy HtoD ...", "Memset (Device)")."""
    if event.kind:
        return event.kind
    return "gpu_memcpy" if event.name.startswith("Memcpy") else "gpu_memset" if event.name.startswith("Memset") else "kernel"


def device_records(events) -> list:
    """The device's own records of a profile: kernels, copies, memsets (not the annotations mirrored onto it)."""
    return [e for e in events if not e.host and e.kind not in _IGNORED and e.kind != "user_annotation"]


def _owner_and_name(root, dotted: str):
    owner = root
    *path, name = dotted.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _ranged(fn, label: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(f"phase: {label}"):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def wrapped(module, wrap, extra=()):
    """Replace the functions a forward of the generated `module` runs through (`GENERATED`, `KERNELS`, and `extra`:
    (module path, dotted name, label) triples) by `wrap(fn, label)` while the block runs (restored after)."""
    import importlib

    targets = [(module, dotted, label) for dotted, label in GENERATED]
    targets += [(importlib.import_module(path), dotted, label) for path, dotted, label in (*KERNELS, *extra)]
    saved = []
    try:
        for root, dotted, label in targets:
            owner, name = _owner_and_name(root, dotted)
            fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, fn))
            setattr(owner, name, wrap(fn, label))
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


@contextlib.contextmanager
def phases(module):
    """Label the host phases of the generated `module`'s forwards while the block runs (restored after)."""
    with wrapped(module, _ranged):
        yield


@dataclass
class Gap:
    start_ms: float  # from the call's start
    length_ms: float
    phase: str  # innermost host phase at the gap's start
    call: str  # the host CUDA call in flight at the gap's start, if any


@dataclass
class Timeline:
    wall_ms: float
    busy_ms: float
    first_kernel_ms: float
    phases: list[tuple[str, float, float, int]]  # label, start ms, duration ms (first call), calls
    gaps: list[Gap]


def _union(intervals):
    merged = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return merged


def _innermost(ranges, t):
    inside = [r for r in ranges if r[1] <= t < r[1] + r[2]]
    return min(inside, key=lambda r: r[2])[0] if inside else "-"


def timeline(events, min_gap_us: float = 50.0) -> Timeline:
    """The phases and the device's idle gaps of one profiled call (see the module docstring)."""
    host = [e for e in events if e.host and e.kind not in _IGNORED]
    marks = [e for e in host if e.name.startswith("phase: ")]
    calls = [e for e in host if e.name.startswith(("cuda", "cu")) and e.kind != "user_annotation"]
    device = device_records(events)
    if not marks or not device:
        raise ValueError("no phase ranges or no device activity in the profile: run the call inside phases() on a GPU")
    t0 = min(e.start_ns for e in marks)
    end = max(max(e.start_ns + e.duration_ns for e in marks), max(e.start_ns + e.duration_ns for e in device))
    ranges = [(e.name[len("phase: "):], e.start_ns, e.duration_ns) for e in marks]
    first, counts = {}, {}
    for label, start, length in sorted(ranges, key=lambda r: r[1]):
        first.setdefault(label, (start, length))
        counts[label] = counts.get(label, 0) + 1
    busy = _union([(e.start_ns, e.start_ns + e.duration_ns) for e in device])
    gaps, cursor = [], t0
    for start, stop in busy + [[end, end]]:
        if start - cursor >= min_gap_us * 1e3:
            call = next((c.name for c in calls if c.start_ns <= cursor < c.start_ns + c.duration_ns), "")
            gaps.append(Gap((cursor - t0) / 1e6, (start - cursor) / 1e6, _innermost(ranges, cursor), call))
        cursor = max(cursor, stop)
    return Timeline(
        wall_ms=(end - t0) / 1e6,
        busy_ms=sum(stop - start for start, stop in busy) / 1e6,
        first_kernel_ms=(busy[0][0] - t0) / 1e6,
        phases=[(label, (s - t0) / 1e6, d / 1e6, counts[label]) for label, (s, d) in sorted(first.items(), key=lambda kv: kv[1][0])],
        gaps=gaps,
    )


def report(t: Timeline, title: str) -> str:
    idle = sum(g.length_ms for g in t.gaps)
    lines = [
        (
            f"--- {title}: wall {t.wall_ms:.2f} ms, device busy {t.busy_ms:.2f} ms, first kernel at "
            f"{t.first_kernel_ms:.2f} ms, idle in gaps >= 50 us: {idle:.2f} ms"
        ),
        "phase                 start ms   host ms  calls",
    ]
    lines += [f"{label:<20} {start:9.2f} {length:9.2f} {n:6d}" for label, start, length, n in t.phases]
    lines.append("idle gap  at ms   length ms  host phase            host CUDA call")
    lines += [f"          {g.start_ms:8.2f} {g.length_ms:9.2f}  {g.phase:<20}  {g.call}" for g in t.gaps]
    return "\n".join(lines)
