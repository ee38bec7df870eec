"""The GDN launch count bench (`bench/gdn_rounds_launches.py`): joint rounds launch the state-free
stages once per layer, the state stages once per round."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gdn_rounds_launches


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gdn_launches") / "report.txt"
    # 2 and 3 rounds: the interpreter is slow on 2 cores, and the counts are linear in the rounds
    return gdn_rounds_launches.main(["--prompt", "64", "--turn", "64", "--response", "2", "--rounds", "2", "3",
                                     "--out", str(out)])


def test_the_bench_builds_the_plans_asked_for(results):
    assert sorted(results) == [2, 3]


@pytest.mark.parametrize("rounds", [2, 3])
def test_per_round_stages_launch_every_stage_once_per_round(results, rounds):
    counts = results[rounds]["per-round"]
    # l2norm of q and k; cumsum, wy, state, output per round / state (recomputed), state backward,
    # output backward, wy backward, reverse cumsum per round; l2norm backward of q and k
    assert counts["forward"]["triton"] == 2 + 4 * rounds
    assert counts["backward"]["triton"] == 2 + 5 * rounds


@pytest.mark.parametrize("rounds", [2, 3])
def test_joint_rounds_launch_state_free_stages_once(results, rounds):
    counts = results[rounds]["joint"]
    assert counts["forward"]["kernels"]["triton:chunk_cumsum_kernel"] == 1
    assert counts["forward"]["kernels"]["triton:wy_fwd_kernel"] == 1
    assert counts["forward"]["kernels"]["triton:chunk_state_fwd_kernel"] == rounds
    assert counts["forward"]["triton"] == 2 + 2 + 2 * rounds
    assert counts["backward"]["kernels"]["triton:wy_bwd_kernel"] == 1
    assert counts["backward"]["triton"] == 2 + 2 + 3 * rounds


@pytest.mark.parametrize("rounds", [2, 3])
def test_joint_rounds_need_no_more_glue(results, rounds):
    for phase in ("forward", "backward"):
        assert results[rounds]["joint"][phase]["glue"] < results[rounds]["per-round"][phase]["glue"]
