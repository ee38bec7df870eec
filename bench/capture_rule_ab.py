"""The layer graphs' capture rules (and the plan's alignment) A/B in one process: `scoring_loop.py` runs with one of
its rule options (`--option`) taking each of `--ways` in turn, `--rounds` times, so that both arms meet the same host
(on the H200 the same code moved 30 % between processes, docs/bench twelfth session). The first run also compiles:
read the rounds after it.

    python bench/capture_rule_ab.py --option first-calls --ways eager,capture --rounds 3 -- --vary --batches 12 \\
        --repeats 2 --layers 8 --scoring eager --shapes 4x2048x256
    python bench/capture_rule_ab.py --option min-calls --ways 1,3 -- ...

`--min-calls 1` captures wherever a second layer of a kind runs (as before the rule), 3 is the rule's default;
`--first-calls eager` runs every pass's first layer of a kind eagerly (as before `capture_guard.py`), `capture` is the
default; `--chunk-aligned on` plans with `shared_prefix_chunk_aligned` (no GDN gathers, a few rows more), `off` is the
default; `--placeholder-scan pytree` checks the layer tape's placeholder arguments with torch's pytree walks, as before
the fifteenth session, `plain` is `graph_tape.py`'s scan.
"""

from __future__ import annotations

import argparse

import scoring_loop

OPTIONS = ("min-calls", "first-calls", "chunk-aligned", "placeholder-scan")


def main(argv=None) -> list[tuple[str, list]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--option", choices=OPTIONS, default="min-calls", help="the scoring_loop.py option the ways set")
    parser.add_argument("--ways", default="1,3", help="the option's values, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("loop", nargs=argparse.REMAINDER, help="after --: scoring_loop.py's arguments")
    args = parser.parse_args(argv)
    loop = args.loop[1:] if args.loop[:1] == ["--"] else args.loop
    option = f"--{args.option}"
    if option in loop:
        raise SystemExit(f"{option} is this script's to set: give its values in --ways")
    ways = args.ways.split(",")
    return [(way, scoring_loop.main([*loop, option, way])) for _ in range(args.rounds) for way in ways]


if __name__ == "__main__":
    main()
