"""A scoring forward's per-layer plan ops captured once and replayed for every layer of that forward.

Every GDN layer of one forward runs its GDN rounds and its conv on the same plan (the same chunk tables,
the same state hand-over, the same look-back rows) with inputs of the same shapes; only the values differ,
and neither op reads a weight beyond the conv's few taps. Run eagerly, each layer launches these ops'
kernels through fla's (or our) Python wrappers and Triton's launcher: on the H200 about as much host time
per layer as the layer's GPU work at n=4 P=2048, which makes an eager scoring forward host-bound
(docs/bench/README.md, the log-prob pass's host profile). Here, per op, the process's first forward runs its first
layer eagerly (any compile or autotuning happens there, never under a capture, and the plan's lazily built index
tensors are made there), the second captures the op on static copies of its inputs and replays it, and every later
layer copies its inputs in and replays: a few copies and one graph launch per op and layer. Once a pass of its kind
has run, a forward on a new plan captures at its first layer, watched for a kernel or table not made yet
(`capture_guard.py`: the layer then runs eagerly and the second captures). A capture is made only where enough calls
of its pass are left to repay it (`CallGraphs._pays`).

A replay runs the captured kernels with the captured launch parameters on the same rows, so its output is
the eager call's bit for bit. The graphs serve only calls that need no autograd node (a scoring forward:
`no_grad`, `inference_mode`, or inputs that want no gradient), on CUDA, outside another capture (the
layer-stack graphs of `shared_prefix_cuda_graphs` capture these ops themselves, on padded plans), and ops
whose kernels read every table from the plan (`plan_tables`: nothing cached by tensor identity that a
graph could outlive). One graph per op is kept, the last forward's: its inputs, outputs and working memory
(a few hundred MB at 4B widths and 6k rows) stay allocated until a forward on another plan replaces it or
`release_call_graphs()` drops it. ``PATCHGEN_CALL_GRAPHS=1`` turns them on, ``=0`` off; unset, they follow
`ON_BY_DEFAULT`.

Every graph of a device is captured on one side stream into one memory pool, so a graph captured for the next
plan reuses the working memory of the one it replaces: a graph with a pool of its own would leave that pool
reserved when it goes (torch frees a dead graph's pool only on `empty_cache` or an allocation that fails outside
a capture), a few hundred MB more per plan. The graphs may share working memory because their replays never
overlap: a lock makes each op's copy, replay and output copy one step for the process (models may score in
several threads), and a replay waits for the last one when the caller runs on another stream. The layer-stack
graphs' warm-ups hold the call graphs off (`held_off`): they route every allocation of the device into the stack's
pool, a call graph's capture included.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import SettingError
from . import capture_guard
from .capture_failure import restore_after_failed_capture
from .graph_tape import EMPTY_GRAPH, Tape

ENV_CALL_GRAPHS = "PATCHGEN_CALL_GRAPHS"
# On since their first GPU run (2026-12-03): bit-equal to the eager ops on fla and ours, under no_grad and inference
# mode, and the 32-layer eager scoring loop faster at n=4 P=2048 (86.4 -> 79.3 ms a micro-batch; docs/bench).
ON_BY_DEFAULT = True
# the whole decoder layer of a kind (`modeling/scoring_layers.py`). On since its first GPU runs (2026-12-03): bit-equal,
# and the 32-layer eager scoring loop at n=4 P=2048 from 79.8 to 60.6 ms a micro-batch (efficiency 0.64 to 0.83);
# with the linears left out of the graphs (`graph_tape.py`) 57.1-57.7 ms (0.88-0.89), n=8 P=4096 from 119.2 to
# 113.9-115.1 ms (0.84 to 0.86-0.87)
ENV_LAYER_GRAPHS = "PATCHGEN_LAYER_GRAPHS"
LAYERS_ON_BY_DEFAULT = True
# the fewest calls of a pass, the captured one included, for which a capture is worth its host time (`CallGraphs._pays`):
# at 8 layers a forward's two attention layers run eagerly, its GDN layers from the second on replay
MIN_CALLS_TO_CAPTURE = 3
# a pass on a new plan captures at its first call once a pass of its kind has run (`capture_guard.py`): an eager layer
# less per kind and forward
CAPTURE_FIRST_CALLS = True
# the passes of a kind that guide its next one (`CallGraphs._pays`): a policy and a reference or reward model scoring in
# turn each see the other's
GUIDING_PASSES = 2


def enabled_in(environ=None, name: str = ENV_CALL_GRAPHS, default: bool | None = None) -> bool:
    """Whether the graphs that `name` switches are on: its environment variable (1 or 0), else `default`
    (`ON_BY_DEFAULT` unless given); any other value is an error rather than silently ignored."""
    value = (os.environ if environ is None else environ).get(name, "").strip()
    if value in ("1", "0"):
        return value == "1"
    if value:
        raise SettingError(f"environment variable {name}={value!r}: expected 1 (on) or 0 (off), or unset it")
    return ON_BY_DEFAULT if default is None else default


class CallGraphUnavailable(UserWarning):
    """A call graph could not be captured: this process's scoring forwards run the plan ops eagerly."""


@dataclass
class _Entry:
    key: tuple
    index: object  # the plan's index of this op: held, so that `key`'s id of it stays its own
    statics: list[torch.Tensor]
    graph: object  # torch.cuda.CUDAGraph, a `graph_tape.Tape` of graphs and linears (a stand-in in the CPU tests)
    out: torch.Tensor
    groups: tuple[tuple[int, ...], ...] = ()  # the inputs' positions by dtype (`_copy_in`); () for all in one


def _by_dtype(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, x in enumerate(tensors):
        groups.setdefault(x.dtype, []).append(i)
    return tuple(tuple(group) for group in groups.values())


def _copy_in(entry: _Entry, inputs: Sequence[torch.Tensor]) -> None:
    """Copy `inputs` into the entry's statics, one `_foreach_copy_` per dtype: a list of one dtype takes torch's
    multi-tensor kernel, a mixed one falls back to a copy (a memcpy, about 10 us of host time) per tensor, which
    for a decoder layer's twenty-odd weights is most of a replay's host time."""
    if len(entry.groups) <= 1:
        torch._foreach_copy_(entry.statics, list(inputs))
        return
    for group in entry.groups:
        torch._foreach_copy_([entry.statics[i] for i in group], [inputs[i] for i in group])


class CallGraphs:
    """Per op, the last scoring forward's graph (see the module docstring)."""

    def __init__(self, enabled: bool | None = None, env: str = ENV_CALL_GRAPHS, default: bool | None = None,
                 what: str = "a scoring forward's plan ops"):
        self._enabled = enabled
        self.env, self.default, self.what = env, default, what
        self.entries: dict[str, _Entry] = {}
        self._seen: dict[str, tuple] = {}  # op -> (key last run eagerly, weak reference to its index)
        self._pass: dict[str, list] = {}  # op -> [weak reference to the index, key, calls so far] of this pass
        self._per_pass: dict[tuple, tuple] = {}  # (op, `_pass_kind`) -> calls of the last such passes that ended
        self.captures = self.replays = 0  # for reports and tests
        self.not_warm = 0  # first calls' captures dropped for a kernel or table not made yet (`capture_guard.py`)
        self._lock = threading.Lock()
        self._held = 0  # layer-stack warm-ups under way (`held_off`)
        self._capture_on: dict[torch.device, tuple] = {}  # device -> (memory pool, side stream) of every capture
        self._last_stream: dict[torch.device, object] = {}  # device -> stream of the last replay
        self._local = threading.local()  # `capturing`

    @property
    def enabled(self) -> bool:
        if self._enabled is None:  # read at first use, so that a wrong value fails a forward, not an import
            self._enabled = enabled_in(name=self.env, default=self.default)
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value

    def applies(self, kernels, inputs: Sequence[torch.Tensor]) -> bool:
        return self.enabled and not self._held and self._serves(kernels, inputs)

    def _serves(self, kernels, inputs: Sequence[torch.Tensor]) -> bool:
        return (
            self.on_device(inputs[0])
            and getattr(kernels, "plan_tables", False)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs))
            and not torch.cuda.is_current_stream_capturing()
        )

    @staticmethod
    def on_device(x: torch.Tensor) -> bool:
        """Whether `x`'s device can capture (CUDA; the CPU tests' stand-ins say yes to the CPU)."""
        return x.is_cuda

    def release(self, timeout: float = -1) -> bool:
        """Drop the kept graphs and their memory; False, dropping nothing, when another thread held them past
        `timeout` seconds (a negative one waits as long as it takes)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            for op in list(self.entries):  # the graphs before their pool
                self._drop(op)
            self._seen.clear()
            # a training step releases the graphs between scoring forwards: the passes it ends guide the next ones
            for op in list(self._pass):
                self._end_pass(op)
            self._capture_on.clear()
            self._last_stream.clear()
        finally:
            self._lock.release()
        return True

    @contextlib.contextmanager
    def held_off(self):
        """No call graph inside (every thread): the layer-stack graphs' warm-ups, whose allocations all go to the
        stack's pool (`graphs.replay.allocating_to`); a capture there would leave its working memory in that pool,
        free for the warm-up's tensors while the graph still writes it at every replay."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1

    def run(self, op: str, index, settings: tuple, body: Callable, inputs: Sequence[torch.Tensor],
            live: Sequence[torch.Tensor] = ()):
        """`body(*inputs, *live)` from a replay, or None where the caller runs it eagerly (a forward's first layer).

        `index` is the plan's part the op reads (the same object in every layer of a forward), `settings` whatever
        else the captured kernels depend on besides the inputs' shapes (the backend, scale, flags). `inputs` are
        copied into the graph's statics; `live` are linears' weights, which the graph leaves out and a replay reads
        where they are (`graph_tape.py`)."""
        key = (id(index), settings, tuple((x.shape, x.dtype) for x in (*inputs, *live)), inputs[0].device,
               torch.is_inference_mode_enabled())
        # one thread at a time from the copy into the static inputs to the copy of the output: another thread's
        # copy in between would have this replay read its inputs
        with self._lock:
            self._after_last_replay(inputs[0].device)
            calls = self._count(op, index, key)
            entry = self.entries.get(op)
            if entry is None or entry.key != key:
                seen = self._seen.get(op)
                first = seen is None or seen[0] != key or seen[1]() is not index
                if first:  # the first call on this key: eager, unless a pass of its kind has run (`_warm`)
                    self._seen[op] = (key, weakref.ref(index))
                    if not self._warm(op, key):
                        self._ran_here().add((op, _pass_kind(key)))
                        return None
                if not self._pays(op, key, calls):
                    if entry is not None:  # a graph of another plan: its memory is of no more use
                        self._drop(op)
                        del entry
                        self._forget_idle_pools()
                    return None
                # the last forward's graph is replaced, but lives until its successor is captured: torch 2.11 fails
                # a capture into a pool whose last graph is gone (an internal assertion of its host allocator,
                # "use_count > 0", on the H200: bench/graph_capture_wait.py's note in docs/bench)
                replaced = entry
                self._drop(op)
                entry = self._capture_or_give_up(key, index, body, inputs, live, first)
                if entry is not None:
                    self.entries[op] = entry
                elif first and replaced is not None and self.enabled:
                    # not warm (`_capture_or_give_up`): the last graph is kept, and its pool with it, until the next call's
                    # capture replaces it, as after an eager first call
                    self.entries[op] = replaced
                del replaced
                self._forget_idle_pools()  # the replaced graph's (or a dropped capture's), when the last on its device
                if entry is None:
                    return None
            _copy_in(entry, inputs)
            entry.graph.replay(*live)
            self.replays += 1
            return entry.out.clone()

    def _count(self, op: str, index, key: tuple) -> int:
        """This call's number in its pass (the calls of `op` on one index with one key: a forward's layers of a kind),
        noting the length of the pass it ends."""
        current = self._pass.get(op)
        if current is None or current[0]() is not index or current[1] != key:
            self._end_pass(op)
            current = self._pass[op] = [weakref.ref(index), key, 0]
        current[2] += 1
        return current[2]

    def _end_pass(self, op: str) -> None:
        """Note the length of `op`'s pass under way, if any, as its kind's guide (`_pays`), and end it."""
        current = self._pass.pop(op, None)
        if current is not None:
            kind = (op, _pass_kind(current[1]))
            self._per_pass[kind] = (*self._per_pass.get(kind, ()), current[2])[-GUIDING_PASSES:]

    def _warm(self, op: str, key: tuple) -> bool:
        """Whether a pass of this kind has run, its first call eagerly in this thread (compiling and tuning its
        kernels, and making what a thread makes on first use: its cuBLAS handle), so that a pass on a new plan may
        capture at its first call (`capture_guard.py`)."""
        kind = (op, _pass_kind(key))
        return (CAPTURE_FIRST_CALLS and kind in self._per_pass and kind in self._ran_here()
                and capture_guard.available())

    def _ran_here(self) -> set:
        """The (op, kind) pairs whose first call this thread ran eagerly."""
        ran = getattr(self._local, "ran", None)
        if ran is None:
            ran = self._local.ran = set()
        return ran

    def _pays(self, op: str, key: tuple, calls: int) -> bool:
        """Whether a capture at this call of its pass pays for itself: a capture costs the host about two eager calls
        (the call's Python under capture, and a graph to begin, end and instantiate per segment), a replay a sixth of
        one (docs/bench, twelfth session: 8 layers, n=4, on the H200), so with `left` calls of the pass to go, this one
        included, the graphs cost about 2 + left / 6 eager calls against `left`: they pay from three on. The length of
        a pass is taken from the last ones of its kind (the same model runs the same layers); before any has ended, it
        is taken to pay. The longest of the last `GUIDING_PASSES` is taken: two models of one kind of layer may score in turn,
        and a shallow one's short passes would otherwise keep a deep one from ever capturing (a capture too many costs
        about two eager calls, one too few all the calls of the pass)."""
        per_pass = self._per_pass.get((op, _pass_kind(key)))
        return per_pass is None or max(per_pass) - calls + 1 >= MIN_CALLS_TO_CAPTURE

    def _after_last_replay(self, device: torch.device) -> None:
        """Order what follows after the device's last replay when the caller runs on another stream: the graphs share
        their pool's working memory, and each graph its static inputs and output."""
        if device.type != "cuda":
            return
        stream, last = torch.cuda.current_stream(device), self._last_stream.get(device)
        if last is not None and last != stream:
            stream.wait_stream(last)
        self._last_stream[device] = stream

    def _drop(self, op: str) -> None:
        entry = self.entries.pop(op, None)
        if entry is not None and entry.statics[0].is_cuda:
            # a replay on another stream than the one they were made on may still read them: the caller's, or the
            # last replay's when the graphs are released from another stream
            device = entry.statics[0].device
            streams = {torch.cuda.current_stream(device), self._last_stream.get(device)} - {None}
            # record_stream marks its tensor as written: an inference tensor takes it inside inference mode only
            with torch.inference_mode(entry.statics[0].is_inference()):
                for static in (*entry.statics, *getattr(entry.graph, "buffers", ())):
                    for stream in streams:
                        static.record_stream(stream)

    def _forget_idle_pools(self) -> None:
        """Drop the pool and side stream of every device that no kept graph is on, after the graphs that went: a
        capture into a pool whose graphs are all gone fails (torch 2.11, see `run`), and the pool would hold its
        working memory meanwhile. Models on two devices of one process replace each other's graphs."""
        devices = {entry.statics[0].device for entry in self.entries.values()}
        for device in [device for device in self._capture_on if device not in devices]:
            del self._capture_on[device]

    def _capture_stream_and_pool(self, device: torch.device):
        found = self._capture_on.get(device)
        if found is None:
            with torch.cuda.device(device):
                pool = torch.cuda.MemPool() if hasattr(torch.cuda, "MemPool") else None  # torch < 2.8: one pool each
                found = self._capture_on[device] = (pool, torch.cuda.Stream(device))
        return found

    @property
    def capturing(self) -> bool:
        """Whether this thread is capturing one of these graphs now (ops refuse to be captured on tables of their
        own making: `shared_prefix.gdn.check_plan_tables`)."""
        return getattr(self._local, "capturing", False)

    def _capture_or_give_up(self, key, index, body, inputs, live=(), first: bool = False) -> _Entry | None:
        """The capture's entry; None where it failed (the graphs are then off for the process, with a warning) or, at
        a pass's `first` call, where it met a kernel or table an eager call makes first (`capture_guard.NotWarm`: the
        call runs eagerly, the next one captures)."""
        self._local.capturing = True
        spared = capture_guard.NotWarm if first else ()
        try:
            if not first:
                return self._capture(key, index, body, inputs, live)
            with capture_guard.no_new_kernels():
                return self._capture(key, index, body, inputs, live)
        except spared:
            self.not_warm += 1
            return None
        except Exception as error:  # noqa: BLE001 - a failed capture leaves the eager ops, which work
            self.enabled = False
            if inputs[0].is_cuda:
                # under the lock, so no other capture records to this pool
                pool = self._capture_on.get(inputs[0].device, (None,))[0]
                restore_after_failed_capture(inputs[0].device, pool=None if pool is None else pool.id,
                                             off=f"set {self.env}=0")
            warnings.warn(
                f"{self.what} could not be captured into a CUDA graph ({error}); they run eagerly "
                f"from now on ({self.env}=0 skips the attempt)",
                CallGraphUnavailable,
                stacklevel=4,
            )
            return None
        finally:
            self._local.capturing = False

    def _capture(self, key, index, body, inputs, live=()) -> _Entry:
        device = inputs[0].device
        statics = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in inputs]
        torch._foreach_copy_(statics, list(inputs))
        pool, side = self._capture_stream_and_pool(device)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        _clear_cublas_workspaces()
        try:
            with torch.cuda.stream(side):
                if live:
                    graph = Tape(pool, current)
                    out = graph.record(body, statics, live)
                else:
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: the capture fails only on what this thread does
                    graph.capture_begin(pool=None if pool is None else pool.id, capture_error_mode="thread_local")
                    try:
                        out = body(*statics)
                        if not isinstance(out, torch.Tensor):  # a replay hands back a copy of one output tensor
                            raise TypeError(f"the captured call returned {type(out).__name__}, not a tensor")
                    except BaseException:
                        # a capture dropped before its first kernel (`capture_guard.NotWarm`) is empty: torch's
                        # warning that it was made on the wrong stream would mislead
                        with warnings.catch_warnings():
                            warnings.filterwarnings("ignore", message=EMPTY_GRAPH)
                            graph.capture_end()
                        raise
                    graph.capture_end()
        finally:
            _clear_cublas_workspaces()
        current.wait_stream(side)
        self.captures += 1
        return _Entry(key, index, statics, graph, out, _by_dtype(statics))


def _pass_kind(key: tuple) -> tuple:
    """What passes of one kind share from one forward to the next (`CallGraphs.run`'s key without the plan and the
    row count, which a new layout changes): the settings, the inputs' shapes with every extent equal to the row count
    (the first input's second dimension) left out, their dtypes, the device and the inference mode. A model kept in
    float32 under autocast hands its second layer bfloat16: its first layer is a pass of a kind of its own; a model of
    other widths runs other kernels (`capture_guard.py`)."""
    _, settings, shapes, device, inference = key
    first = shapes[0][0] if shapes else ()
    rows = first[1] if len(first) > 1 else None
    extents = tuple((tuple(-1 if n == rows else n for n in shape), dtype) for shape, dtype in shapes)
    return settings, extents, device, inference


def _clear_cublas_workspaces() -> None:
    """Let a capture's cuBLAS workspace be its own. cuBLAS keeps one workspace per handle and stream: one made during a
    capture lives in the graphs' pool and would be shared by every later capture on the side stream, outlive a
    released pool, and be freed twice when the process exits (glibc's "double free or corruption" after a layer
    graph, whose linears call cuBLAS, on the H200). Cleared before a capture, the capture allocates a workspace in
    the pool; cleared after, the pool alone holds it, like any block the graph uses (torch's cudagraph trees do the
    same)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


CALL_GRAPHS = CallGraphs()
LAYER_GRAPHS = CallGraphs(env=ENV_LAYER_GRAPHS, default=LAYERS_ON_BY_DEFAULT, what="a scoring forward's decoder layers")


def release_call_graphs() -> None:
    """Drop the graphs the last scoring forward kept, and their memory (they are captured again when next needed)."""
    CALL_GRAPHS.release()
    LAYER_GRAPHS.release()


def _release_at_exit() -> None:
    # the graphs go while torch's CUDA state is whole: left to the interpreter's teardown, a graph and its pool may be
    # destroyed after the allocator they return memory to. A daemon thread stopped mid-replay keeps its lock: the
    # exit waits a second for it, never for ever
    for graphs in (CALL_GRAPHS, LAYER_GRAPHS):
        graphs.release(timeout=1.0)


atexit.register(_release_at_exit)


@contextlib.contextmanager
def held_off():
    """No call graph of either kind inside (`CallGraphs.held_off`)."""
    with CALL_GRAPHS.held_off(), LAYER_GRAPHS.held_off():
        yield
