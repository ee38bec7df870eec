"""A stub device environment for the one-call device scripts (bench/*_run.sh) on the CPU: `GPU_ENV` that
puts a `python` first on PATH which prints its arguments and exits 3, so every part runs and fails at once."""

import os
import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_device_script(tmp_path, script: str, **env_extra) -> tuple[subprocess.CompletedProcess, Path]:
    """``bash bench/<script>`` under the stub; returns the process and its ``OUT`` folder."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "python").write_text('#!/bin/sh\necho "fake python $*"\nexit 3\n')
    (stub / "python").chmod(0o755)
    (stub / "env.sh").write_text(f"export PATH={stub}:$PATH T371=/nonexistent PYTHONPATH=/nonexistent\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "GPU_ENV": str(stub / "env.sh"), **{k: str(v) for k, v in env_extra.items()}}
    proc = subprocess.run(["bash", str(BENCH / script)], check=False, cwd=BENCH.parent, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, out
