"""Merge `bench/shared_prefix_gpu.py` CSVs of one machine (runs split over GPUs or calls) by shape.

    python bench/merge_shared_prefix.py OUT.csv RUN.csv [RUN.csv ...]

Each column of a shape comes from the first CSV that has it; the ratios are recomputed from the
merged columns (our packed vs upstream needs both), and rows follow the grid's order.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from shared_prefix_gpu import CONTROLS, GRID, parse_shapes, ratios, write


def number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def merge(paths: list[Path]) -> list[dict]:
    rows: dict[str, dict] = {}
    for path in paths:
        for row in csv.DictReader(path.open()):
            merged = rows.setdefault(row["shape"], {})
            for key, value in row.items():
                if value != "" and key not in merged:
                    merged[key] = number(value)
    for row in rows.values():
        row["T"], row["C"] = int(row["T"]), int(row["C"])
        for key in [k for k in row if k.startswith(("speedup_", "efficiency_", "packed_vs_upstream_"))]:
            del row[key]
        if "packed_train_ms" in row and "shared_train_ms" in row:
            ratios(row)
    order = [name for name, *_ in parse_shapes(",".join(GRID + CONTROLS))]
    rank = {name: i for i, name in enumerate(order)}
    return sorted(rows.values(), key=lambda row: rank.get(row["shape"], math.inf))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    rows = merge(args.runs)
    write(rows, args.out)
    print(f"wrote {args.out}: {len(rows)} shapes")


if __name__ == "__main__":
    main()
