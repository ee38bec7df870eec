"""Runs the targets' pipelines, the models split over two processes when the machine has two cores free.

The device targets of one model share their parsed and edited trees (pipeline.py), so the work splits
by model: this process generates the first half of the models, a forked child the rest, and the child
sends its results back through a pipe. Results and errors come out exactly as a sequential run gives
them: in target order, the first failing target's error raised.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from typing import TypeVar

from patchgen.targets import Target

Result = TypeVar("Result")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_targets(
    generate_one: Callable[[Target], Result], selected: list[Target], jobs: int | None = None
) -> list[Result]:
    """[generate_one(t) for t in selected], split by model over `jobs` processes (default: two if the
    machine has two cores and more than one model is selected; 1 runs everything here)."""
    models = list(dict.fromkeys(t.model for t in selected))
    jobs = min(2, usable_cores()) if jobs is None else jobs
    if jobs < 2 or len(models) < 2 or not _can_fork():
        return [generate_one(t) for t in selected]
    # Models in order, the first half here: an error in an earlier target is raised first, as it would be.
    here_models = set(models[: (len(models) + 1) // 2])
    here = [t for t in selected if t.model in here_models]
    there = [t for t in selected if t.model not in here_models]
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(generate_one, there, send), daemon=True)
    child.start()  # multiprocessing flushes stdout and stderr first: the child writes no copy of them
    send.close()  # the child holds the sending end: recv() sees EOF if it dies
    try:
        mine = [generate_one(t) for t in here]
        try:
            theirs = receive.recv()
        except (EOFError, OSError):  # the child died without an answer (killed, out of memory)
            theirs = None
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()
    if theirs is None:
        theirs = [generate_one(t) for t in there]  # do its share here: slower, never a missing result
    elif isinstance(theirs, BaseException):
        raise theirs
    by_target = dict(zip(here, mine)) | dict(zip(there, theirs))
    return [by_target[t] for t in selected]


def _can_fork() -> bool:
    # A fork copies only the calling thread: with other Python threads running (an embedding program),
    # one of them could hold a lock the child needs. The command line runs one thread.
    # A daemonic process (a multiprocessing pool's worker) may not start children of its own.
    return (
        "fork" in multiprocessing.get_all_start_methods()
        and threading.active_count() == 1
        and not multiprocessing.current_process().daemon
    )


def _child(generate_one, targets: list[Target], send) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to report
    try:
        answer = [generate_one(t) for t in targets]
    except BaseException as exc:  # noqa: BLE001 (every error goes back to be raised in the parent)
        answer = exc
    try:
        send.send(answer)
    except Exception as exc:  # noqa: BLE001 (an error that does not pickle still reaches the parent)
        send.send(RuntimeError(f"{type(answer).__name__}: {answer} ({type(exc).__name__} sending it: {exc})"))
    finally:
        send.close()
