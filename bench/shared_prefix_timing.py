"""How `bench/shared_prefix_gpu.py` times a step: wall clock, peak memory, host syncs, and host vs GPU time.

Wall time: CUDA events around the call on a GPU (the host clock after a sync elsewhere), after
warm-up, repeated until `repeat_ms` of timed calls or `repeats` calls (at least `min_repeats`).

Host vs GPU time of one step (`split_step`), from one step under `torch.profiler` (CPU and CUDA
activities):
- GPU ms: the device's busy time, the union of the intervals of every kernel, copy and memset
  (CUPTI's device timestamps; the profiler does not slow the kernels). It is what the step would
  take if the host were never behind.
- host ms: the host's wall time from the call to its return, minus the time it waited for the
  device inside CUDA calls (synchronize calls in full; copies and launches beyond the median call
  of their kind: a device-to-host copy waits for the stream, a launch waits once ~1000 launches are
  pending), minus the profiler's own cost (per host event, measured in the same process by
  `profiler_cost_us`, times the step's host events).
The step is GPU-bound when host ms < GPU ms. Why not events around a step held back by
`torch.cuda._sleep`: CUDA blocks a launch once about a thousand are pending on the stream, so a
step of thousands of kernels cannot be queued behind a sleep, and every host sync inside the step
(the plan is built from the batch on the host) waits for the sleep; both would be timed as host
time.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

GIB = 2**30


class Timer:
    """CUDA events on a GPU, the host clock (after a sync) elsewhere."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        """(ms, what `fn` returned)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), result
        begin = time.perf_counter()
        result = fn()
        return (time.perf_counter() - begin) * 1e3, result


@dataclass(frozen=True)
class Repeats:
    """Timed calls per measurement: `min_repeats` to `repeats`, stopping once `repeat_ms` have been timed."""

    repeats: int
    min_repeats: int = 1
    repeat_ms: float = math.inf

    def more(self, times: list[float]) -> bool:
        if len(times) >= self.repeats:
            return False
        return len(times) < self.min_repeats or sum(times) < self.repeat_ms


@dataclass
class Measurement:
    median: float
    low: float
    high: float
    peak_gib: float  # max_memory_allocated over the timed calls (weights and gradients included)
    step_gib: float  # the same above what was allocated when the timed calls began
    grads_gib: float  # the gradients the last call left (a training step's; 0 for a no-grad pass)
    count: int
    syncs: int  # host syncs in the first timed call (torch's sync debug mode; -1 off CUDA)
    result: object  # what the last call returned (a loss, log-probs)


def measure(model, fn, args, timer, repeats: Repeats, device) -> Measurement:
    """Time `fn(model, *args)` (warm already); peak memory over the timed calls.

    The first timed call also counts host syncs: the debug mode only acts at a sync (a warning), so
    it costs nothing measurable, and no extra call is spent on counting.
    """
    cuda = device.type == "cuda"
    if cuda:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    syncs = [-1]

    def counted():
        with counting_syncs(device) as counter:
            out = fn(model, *args)
        syncs[0] = counter[0]
        return out

    ms, result = timer(counted)  # the timer's own synchronize is outside the count
    times = [ms]
    while repeats.more(times):
        ms, result = timer(lambda: fn(model, *args))
        times.append(ms)
    peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
    grads = gradient_bytes(model)
    model.zero_grad(set_to_none=True)
    return Measurement(
        statistics.median(times),
        min(times),
        max(times),
        peak / GIB,
        (peak - resident) / GIB if cuda else float("nan"),
        grads / GIB,
        len(times),
        syncs[0],
        result,
    )


def gradient_bytes(model) -> int:
    """Bytes of the gradients the model holds (distinct storages once: tied weights share one)."""
    seen = {}
    for p in model.parameters():
        if p.grad is not None:
            seen[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()
    return sum(seen.values())


def is_sync(message) -> bool:
    """A sync debug mode warning about a sync, not its one-time notice that the mode is a prototype (whose text
    says "synchronizing" too)."""
    text = str(message)
    return "synchroniz" in text and "prototype" not in text


@contextlib.contextmanager
def counting_syncs(device):
    """Count host syncs inside the block (torch's sync debug mode reports each as a warning); -1 off CUDA."""
    counter = [-1]
    if device.type != "cuda":
        yield counter
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counter[0] = sum(is_sync(w.message) for w in caught)


@contextlib.contextmanager
def sync_sites(where):
    """Each host sync torch reports inside the block (CUDA's sync debug mode), as `where()` names it: called
    in the frame that synced, so it can read the Python stack. Yields the list it fills."""
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if is_sync(message):
            found.append(where())

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")


def count_syncs(model, fn, ids, cu, max_len, device) -> int:
    """Host syncs during one call of `fn`."""
    with counting_syncs(device) as counter:
        fn(model, ids, cu, max_len)
    return counter[0]


def plan_build_ms(ids, cu, device, repeats=10, **tree) -> float:
    """Host time of `build_plan` (it copies ids and boundaries to the host, then works there)."""
    from patchgen.kernels.shared_prefix import build_plan

    def once():
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        build_plan(ids, cu, **tree)
        return (time.perf_counter() - begin) * 1e3

    once()
    return statistics.median(once() for _ in range(repeats))


# ---- host vs GPU time --------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One profiler record: `host` (a host op or CUDA API call) or a device activity."""

    name: str
    host: bool
    start_ns: int
    duration_ns: int
    kind: str = ""  # the profiler's activity type where it reports one ("kernel", "cuda_runtime", ...)


@dataclass(frozen=True)
class Split:
    host_ms: float  # host work of the step (waits for the device and the profiler's cost taken out)
    gpu_ms: float  # device busy time (nan off CUDA)
    wall_ms: float  # host wall time from the call to its return, under the profiler
    wait_ms: float  # of which the host waited for the device
    profiler_ms: float  # of which the profiler's own cost (estimated)
    kernels: int  # device kernels (copies and memsets not counted)
    host_events: int


# ranges drawn over other records, and the profiler's own bookkeeping
_IGNORED_KINDS = {"gpu_user_annotation", "user_annotation", "python_function", "overhead"}


def _is_wait(name: str) -> bool:
    return "Synchronize" in name


def _kind_of_call(name: str) -> str | None:
    """'copy' or 'launch' for the CUDA calls that can block on a busy device, else None."""
    if name.startswith(("cudaMemcpy", "cuMemcpy")):
        return "copy"
    if name.startswith(("cudaLaunch", "cuLaunch")):
        return "launch"
    return None


def busy_ms(intervals: list[tuple[int, int]]) -> float:
    """Length of the union of `(start_ns, end_ns)` intervals, in ms (overlapping kernels count once)."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e6


def split(events: list[Event], wall_ms: float, cost_us: float, cuda: bool) -> Split:
    """Host vs GPU time of one profiled step (see the module docstring for the definitions)."""
    host = [e for e in events if e.host and e.kind not in _IGNORED_KINDS]
    device = [e for e in events if not e.host and e.kind not in _IGNORED_KINDS]
    wait_ns = sum(e.duration_ns for e in host if _is_wait(e.name))
    for kind in ("copy", "launch"):
        durations = [e.duration_ns for e in host if _kind_of_call(e.name) == kind]
        if durations:
            usual = statistics.median(durations)
            wait_ns += sum(max(0, d - usual) for d in durations)
    profiler_ms = cost_us * len(host) / 1e3
    kernels = sum(
        1
        for e in device
        if (e.kind == "kernel") or (not e.kind and not e.name.startswith(("Memcpy", "Memset")))
    )
    return Split(
        host_ms=max(0.0, wall_ms - wait_ns / 1e6 - profiler_ms),
        gpu_ms=busy_ms([(e.start_ns, e.start_ns + e.duration_ns) for e in device]) if cuda else float("nan"),
        wall_ms=wall_ms,
        wait_ms=wait_ns / 1e6,
        profiler_ms=profiler_ms,
        kernels=kernels if cuda else -1,
        host_events=len(host),
    )


def gpu_ms(call, repeats: int) -> float:
    """Median device ms of `call()` over `repeats` runs (CUDA events around each; one untimed run first)."""
    call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def events_of(prof) -> list[Event]:
    """The profiler's raw records, read without building its event tree (seconds per step at 32 layers)."""
    from torch.autograd import DeviceType

    records = []
    for e in prof.profiler.kineto_results.events():
        kind = e.activity_type() if hasattr(e, "activity_type") else ""
        if hasattr(e, "is_user_annotation") and e.is_user_annotation():
            kind = "user_annotation"
        records.append(
            Event(e.name(), e.device_type() == DeviceType.CPU, e.start_ns(), e.duration_ns(), str(kind))
        )
    return records


def _profiled(fn, device):
    """(wall ms of `fn` from call to return, profiler records); the device is drained before and after."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        begin = time.perf_counter()
        fn()
        wall_ms = (time.perf_counter() - begin) * 1e3
        if cuda:
            torch.cuda.synchronize()
    return wall_ms, events_of(prof)


def profiler_cost_us(device, ops: int = 2000, rounds: int = 3) -> float:
    """The profiler's host cost per host event: a loop of tiny in-place adds, plain and profiled."""
    x = torch.zeros(1, device=device)

    def loop():
        for _ in range(ops):
            x.add_(1)

    costs = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        loop()
        plain_ms = (time.perf_counter() - begin) * 1e3
        wall_ms, events = _profiled(loop, device)
        host = [e for e in events if e.host and e.kind not in _IGNORED_KINDS]
        costs.append(max(0.0, (wall_ms - plain_ms) * 1e3 / max(1, len(host))))
    return statistics.median(costs)


def split_step(fn, device, cost_us: float) -> tuple[Split, object]:
    """Profile one call of `fn` (warm) and split its time into host and GPU; returns what `fn` returned too."""
    out = []
    wall_ms, events = _profiled(lambda: out.append(fn()), device)
    return split(events, wall_ms, cost_us, device.type == "cuda"), out[0]
