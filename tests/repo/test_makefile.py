"""The README's commands work alone on a fresh clone: the environment is made on first use, then reused."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP = "python3 -m venv .venv"


@pytest.fixture
def clone(tmp_path):
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the README's commands need it")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def planned(folder: Path, *goals: str) -> str:
    """What `make` would run (dry run: nothing is executed).

    Run as a top-level make even when the suite itself runs under `make test` (CI): an inherited
    MAKELEVEL / MAKEFLAGS would make it print "Entering directory" lines around the plan.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    return subprocess.run(
        ["make", "-n", *goals], cwd=folder, env=env, check=True, capture_output=True, text=True
    ).stdout


@pytest.mark.parametrize("goal", ["test", "demo", "check", "generate"])
def test_fresh_clone_makes_the_environment_before_running(clone, goal):
    lines = planned(clone, goal).splitlines()
    assert lines[0].startswith(SETUP)
    assert len(lines) > 2  # the set-up, its stamp, then the goal's own command


def test_environment_is_reused_once_made(clone):
    (clone / ".venv").mkdir()
    (clone / ".venv" / ".patchgen-setup").touch()
    assert SETUP not in planned(clone, "test", "demo")


def test_environment_is_made_again_when_pyproject_changes(clone):
    stamp = clone / ".venv" / ".patchgen-setup"
    stamp.parent.mkdir()
    stamp.touch()
    later = time.time() + 5
    os.utime(clone / "pyproject.toml", (later, later))
    assert planned(clone, "test").startswith(SETUP)


def test_setup_installs_the_extras_of_one_variable(clone):
    # CI's set-up installs what the tests import: the dev tools and the trl integration's extra.
    assert "-e '.[dev,trl]'" in planned(clone, "setup")
    assert "-e '.[dev]'" in planned(clone, "setup", "EXTRAS=dev")
