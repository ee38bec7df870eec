"""Wall time of `patchgen --all` and `patchgen --check` (fresh processes, median of N runs).

    python bench/generator_time.py [--repeats 5]

The CLI splits the models over two processes where two cores are free (patchgen/parallel.py); the
"one process" row runs `--check` with that split turned off, for the work alone.

--all writes into a temporary PATCHGEN_OUTPUT_DIR, so the checked-in files are not touched. The CPU
column (user + system time of the child process) is the steadier number on a shared machine, where
wall time also counts waiting for a core; the 1-minute load average before and after the runs says
how shared the machine was (idle: below 1 per core).
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ONE_PROCESS = (
    "import sys, patchgen.parallel as p, patchgen.cli as c; p.usable_cores = lambda: 1; sys.exit(c.main(sys.argv[1:]))"
)


def timed(argv, env, one_process: bool = False) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh `patchgen` process (and the child it forks)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    command = ["-c", ONE_PROCESS] if one_process else ["-m", "patchgen.cli"]
    subprocess.run([sys.executable, *command, *argv], env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        env_all = {**os.environ, "PATCHGEN_OUTPUT_DIR": out}
        arms = (
            ("patchgen --all", ["--all"], env_all, False),
            ("patchgen --check", ["--check"], dict(os.environ), False),
            ("--check, one process", ["--check"], dict(os.environ), True),
        )
        for name, argv, env, one_process in arms:
            runs = [timed(argv, env, one_process) for _ in range(args.repeats)]
            walls, cpus = [w for w, _ in runs], [c for _, c in runs]
            rows.append((name, statistics.median(walls), min(walls), max(walls), statistics.median(cpus), min(cpus)))
    print(
        f"{'command':<22} {'median s':>9} {'min s':>7} {'max s':>7} {'median CPU s':>13} {'min CPU s':>10}"
        f"   ({args.repeats} runs, fresh processes, {os.cpu_count()} cores,"
        f" load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)"
    )
    for name, median, low, high, cpu, cpu_low in rows:
        print(f"{name:<22} {median:>9.2f} {low:>7.2f} {high:>7.2f} {cpu:>13.2f} {cpu_low:>10.2f}")


if __name__ == "__main__":
    main()
