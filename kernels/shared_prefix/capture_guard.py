"""What a capture made without an eager call before it must not meet: a kernel to compile or load, a table to build.

A scoring forward's graphs (`call_graphs.py`) used to be captured at the second call of a pass only, after an eager
first call that had compiled and autotuned the kernels and built the plan's lazily made tables. Both matter:

- Triton compiles a kernel of a new specialisation and loads it before its first launch, and an autotuner benchmarks
  its configurations with the device synchronised. A synchronisation fails a capture, and a failed capture turns the
  graphs off for the process (`CallGraphs._capture_or_give_up`).
- A table built under a capture is written only when the graph replays, in the graph's memory, yet it is kept with the
  plan and read by every eager call after it (`conv.ConvIndex.state_gather`).

Once a pass of its kind has run eagerly, a pass on a new plan meets the same kernels on new shapes. fla's autotuning
keys that follow the rows are constexprs (its norms' `NB`), so a new key compiles new kernels; and the plan's tables
are built with the plan for every key a call asked for before. So a later pass captures at its first call, which
spares the host one eager call per kind of layer and forward, and `no_new_kernels()` watches for what is new anyway:
Triton's loading of a kernel raises `NotWarm` in the capturing thread, before the load and the launch, and so does a
table the plan lacks. The capture is dropped before anything of it ran, and the call runs eagerly, as a first call
always did.

What it cannot see keeps the first calls eager: a thread's first pass of a kind (its cuBLAS handle and whatever else
a thread makes on first use; `CallGraphs._warm`), a kind of other widths (`call_graphs._pass_kind`), and a process
where CUTLASS's CuTe DSL is installed (FA4, liger's CuTe backends: their compiles are not Triton's). An autotuner
keyed on an argument that is not a constexpr would tune on kernels it has loaded and fail the capture; none of the
kernels behind the ops' slots is keyed so (fla 0.6, liger's Triton kernels, ours). A kernel whose load was refused is
loaded at its next launch: Triton 3.7 calls its `_init_handles` again at every launch while
`knobs.runtime.launch_enter_hook` is set, as it is by default (a chain of hooks); a process that sets it to None would
launch that kernel unloaded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading

_local = threading.local()
_hooked = False
_lock = threading.Lock()


class NotWarm(RuntimeError):
    """Something an eager call would have made first (a Triton kernel, a plan's table) was met under a capture."""


def guarded() -> bool:
    """Whether this thread is inside `no_new_kernels()`."""
    return getattr(_local, "guarded", False)


def _on_kernel_load(module=None, function=None, name="", *args, **kwargs) -> None:
    # Triton calls this before it loads a compiled kernel (once per kernel and process, just after a compile or
    # when its binary comes from the disk cache), in the thread about to launch it
    if guarded():
        raise NotWarm(f"Triton kernel {name or '?'} would be compiled or loaded under a capture")


def _load_hooks():
    """Triton's chain of hooks run before a kernel is loaded (Triton 3.4 on), or None without one."""
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one older than its knobs
        return None
    chain = getattr(getattr(knobs, "runtime", None), "kernel_load_start_hook", None)
    return chain if callable(getattr(chain, "add", None)) else None


@functools.cache
def cute_dsl_installed() -> bool:
    """Whether CUTLASS's CuTe DSL is installed: FA4 and liger's CuTe backends (which liger prefers where the DSL is
    usable) compile with `cute.compile` per shape, a compiler Triton's hooks do not see."""
    return importlib.util.find_spec("cutlass") is not None


def available() -> bool:
    """Whether a capture without an eager call before it can be watched: no compiler the guard cannot see is
    installed, and Triton's load hooks are there (the hook is added once, beside any other) or there is no Triton to
    compile anything."""
    global _hooked
    if cute_dsl_installed():
        return False
    if _hooked:
        return True
    try:
        import triton  # noqa: F401
    except ImportError:
        return True
    chain = _load_hooks()
    if chain is None:
        return False
    with _lock:
        if not _hooked:
            chain.add(_on_kernel_load)
            _hooked = True
    return True


@contextlib.contextmanager
def no_new_kernels():
    """Inside, this thread's loading of a Triton kernel raises `NotWarm` (call `available()` first: without Triton's
    hooks nothing is watched)."""
    was = guarded()
    _local.guarded = True
    try:
        yield
    finally:
        _local.guarded = was
