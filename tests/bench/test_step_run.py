"""bench/step_run.sh, the training-step checks in one device call, run on the CPU with a stub environment
and a `python` (and `bash bench/gpu_tests.sh`'s python) that exits at once with 3."""

import re
import tarfile

import pytest

from tests.bench.device_stub import BENCH, run_device_script

SCRIPT = BENCH / "step_run.sh"


def _header_parts() -> list[str]:
    """The parts the script's header documents (`#   name  what it does`)."""
    return re.findall(r"^#   (\w+)\s{2,}\S", SCRIPT.read_text(), flags=re.MULTILINE)


def _run(tmp_path, parts: str, budget: int = 600):
    return run_device_script(tmp_path, "step_run.sh", BUDGET=budget, PARTS=parts)


def test_every_documented_part_runs_says_its_exit_status_and_lands_in_the_tarball(tmp_path):
    parts = _header_parts()
    assert {"level", "sp8", "sp32", "sp32t", "tests", "grpo", "host", "cgraph", "graph"} <= set(parts)
    proc, out = _run(tmp_path, ",".join(parts))
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(out / "step_run.tar.gz") as tar:
        steps = tar.extractfile("s/steps.txt").read().decode()
    for name in ("level", "sp8", "sp32", "sp32t", "gpu-tests", "grpo", "host-32", "cgraph-test", "cgraph-bench", "graph"):
        assert f"== {name}: rc 3 in" in steps, steps


def test_an_unknown_part_is_refused_before_anything_runs(tmp_path):
    proc, out = _run(tmp_path, "tests,nonsense")
    assert proc.returncode == 2 and "unknown part nonsense" in proc.stdout
    assert "rc 3" not in (out / "steps.txt").read_text()


@pytest.mark.parametrize("budget", [20])
def test_parts_the_budget_cannot_hold_are_skipped(tmp_path, budget):
    proc, out = _run(tmp_path, "sp8,sp32,graph", budget=budget)
    assert proc.returncode == 0, proc.stderr
    assert (out / "steps.txt").read_text().count("skipped") == 3
