"""Wall time of `patchgen --all` and `patchgen --check` (fresh processes, median of N runs).

    python bench/generator_time.py [--repeats 5]

--all writes into a temporary PATCHGEN_OUTPUT_DIR, so the checked-in files are not touched.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def timed(argv, env) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "patchgen.cli", *argv], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        env_all = {**os.environ, "PATCHGEN_OUTPUT_DIR": out}
        for name, argv, env in (("patchgen --all", ["--all"], env_all), ("patchgen --check", ["--check"], dict(os.environ))):
            times = [timed(argv, env) for _ in range(args.repeats)]
            rows.append((name, statistics.median(times), min(times), max(times)))
    print(f"{'command':<20} {'median s':>9} {'min s':>7} {'max s':>7}   ({args.repeats} runs, fresh processes)")
    for name, median, low, high in rows:
        print(f"{name:<20} {median:>9.2f} {low:>7.2f} {high:>7.2f}")


if __name__ == "__main__":
    main()
