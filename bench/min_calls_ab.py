"""The layer graphs' capture rule A/B in one process: `scoring_loop.py` runs with `--min-calls` taking each of `--ways`
in turn, `--rounds` times, so that both arms meet the same host (on the H200 the same code moved 30 % between
processes, docs/bench twelfth session). The first run also compiles: read the rounds after it.

    python bench/min_calls_ab.py --ways 1,3 --rounds 2 -- --vary --batches 12 --repeats 2 --layers 8 \\
        --scoring eager --shapes 4x2048x256

`--min-calls 1` captures wherever a second layer of a kind runs (as before the rule), 3 is the rule's default.
"""

from __future__ import annotations

import argparse

import scoring_loop


def main(argv=None) -> list[tuple[int, list]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ways", default="1,3", help="the --min-calls values, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("loop", nargs=argparse.REMAINDER, help="after --: scoring_loop.py's arguments")
    args = parser.parse_args(argv)
    loop = args.loop[1:] if args.loop[:1] == ["--"] else args.loop
    if "--min-calls" in loop:
        raise SystemExit("--min-calls is this script's to set: give the values in --ways")
    ways = [int(way) for way in args.ways.split(",")]
    return [(way, scoring_loop.main([*loop, "--min-calls", str(way)])) for _ in range(args.rounds) for way in ways]


if __name__ == "__main__":
    main()
