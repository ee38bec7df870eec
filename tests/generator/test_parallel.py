"""run_targets: the models split over two processes, with the results and errors of a sequential run."""

import os
import subprocess
import sys

import pytest

from patchgen import parallel
from patchgen.errors import ConfigError
from patchgen.targets import Target

TARGETS = [Target("a", "gpu"), Target("a", "npu"), Target("b", "gpu"), Target("b", "npu"), Target("c", "gpu")]


def where(target):
    return (target.name, os.getpid())


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """These tests fork: as in the command line, no other Python thread runs (whatever earlier tests
    of this pytest process left running)."""
    monkeypatch.setattr(parallel.threading, "active_count", lambda: 1)


def test_a_process_running_other_threads_generates_alone(monkeypatch):
    monkeypatch.setattr(parallel.threading, "active_count", lambda: 2)
    assert {pid for _, pid in parallel.run_targets(where, TARGETS, jobs=2)} == {os.getpid()}


def test_two_jobs_give_the_sequential_results_in_target_order():
    results = parallel.run_targets(where, TARGETS, jobs=2)
    assert [name for name, _ in results] == [t.name for t in TARGETS]
    pids = {name.split("/")[0]: pid for name, pid in results}
    # The first half of the models (a, b) here, the rest (c) in the child.
    assert pids["a"] == pids["b"] == os.getpid() != pids["c"]


def test_one_job_or_one_model_stays_in_this_process():
    assert {pid for _, pid in parallel.run_targets(where, TARGETS, jobs=1)} == {os.getpid()}
    one_model = [t for t in TARGETS if t.model == "a"]
    assert {pid for _, pid in parallel.run_targets(where, one_model, jobs=2)} == {os.getpid()}


def test_an_error_in_the_child_is_raised_here_with_its_type_and_message():
    def fail_on_c(target):
        if target.model == "c":
            raise ConfigError(f"config of {target.name} is broken")
        return target.name

    with pytest.raises(ConfigError, match="config of c/gpu is broken"):
        parallel.run_targets(fail_on_c, TARGETS, jobs=2)


def test_the_earliest_target_error_wins_as_in_a_sequential_run():
    def fail_everywhere(target):
        raise ConfigError(f"broken {target.name}")

    with pytest.raises(ConfigError, match="broken a/gpu"):
        parallel.run_targets(fail_everywhere, TARGETS, jobs=2)


def test_ctrl_c_raised_in_the_child_reaches_this_process():
    def interrupt(target):
        if target.model == "c":
            raise KeyboardInterrupt
        return target.name

    with pytest.raises(KeyboardInterrupt):
        parallel.run_targets(interrupt, TARGETS, jobs=2)


def test_a_child_that_dies_without_answering_has_its_share_done_here():
    parent = os.getpid()

    def die_in_child(target):
        if os.getpid() != parent:
            os._exit(9)  # as if killed: no answer, no exception
        return target.name

    assert parallel.run_targets(die_in_child, TARGETS, jobs=2) == [t.name for t in TARGETS]


def test_what_this_process_printed_before_is_not_printed_again_by_the_child():
    # Into a pipe, stdout is block-buffered: "said once" is still in the buffer when the child forks.
    script = (
        "from patchgen import parallel; from patchgen.targets import Target; "
        "print('said once', end=''); "
        "parallel.run_targets(str, [Target('a', 'gpu'), Target('b', 'gpu')], jobs=2)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout == "said once"


def test_the_real_targets_generate_byte_identical_in_two_processes():
    from patchgen.pipeline import generate
    from patchgen.targets import all_targets

    every = all_targets()
    one = parallel.run_targets(generate, every, jobs=1)
    two = parallel.run_targets(generate, every, jobs=2)
    assert [(r.target, r.python, r.diff, r.upstream_hashes) for r in two] == [
        (r.target, r.python, r.diff, r.upstream_hashes) for r in one
    ]


def test_a_pool_worker_generates_in_its_own_process():
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:  # its workers are daemonic
        results = pool.apply(parallel.run_targets, (where, TARGETS), {"jobs": 2})
    assert len({pid for _, pid in results}) == 1
