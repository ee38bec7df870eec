"""Merge `bench/shared_prefix_gpu.py` CSVs of one machine (runs split over GPUs or calls) by depth and shape.

    python bench/merge_shared_prefix.py OUT.csv RUN.csv [RUN.csv ...]

Each column of a (layers, shape) row comes from the first CSV that has it; the ratios are recomputed
from the merged columns (our packed vs a baseline needs both), and rows follow depth, then the
grid's order. A CSV from before the `layers` column counts as `--layers` (default 8).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from shared_prefix_report import ratios, write
from shared_prefix_shapes import CONTROLS, GRID, parse_shapes

DERIVED = ("speedup_", "efficiency_", "packed_vs_", "memory_ratio_", "step_memory_ratio_")
DERIVED_SUFFIXES = ("_gpu_busy",)


def number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def merge(paths: list[Path], layers: int = 8) -> list[dict]:
    rows: dict[tuple[int, str], dict] = {}
    for path in paths:
        for row in csv.DictReader(path.open()):
            depth = int(float(row.get("layers") or layers))
            merged = rows.setdefault((depth, row["shape"]), {"layers": depth})
            for key, value in row.items():
                if value != "" and key not in merged:
                    merged[key] = number(value)
    for row in rows.values():
        row["T"], row["C"] = int(row["T"]), int(row["C"])
        for key in [k for k in row if k.startswith(DERIVED) or k.endswith(DERIVED_SUFFIXES)]:
            del row[key]
        ratios(row)
    order = [name for name, *_ in parse_shapes(",".join(GRID + CONTROLS))]
    rank = {name: i for i, name in enumerate(order)}
    return [rows[key] for key in sorted(rows, key=lambda k: (k[0], rank.get(k[1], math.inf)))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--layers", type=int, default=8, help="depth of CSVs without a layers column")
    args = parser.parse_args(argv)
    rows = merge(args.runs, args.layers)
    write(rows, args.out)
    print(f"wrote {args.out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
