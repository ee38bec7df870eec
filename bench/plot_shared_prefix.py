"""PNG plots of a `bench/shared_prefix_gpu.py` CSV: speed-up against the bound, peak memory per arm.

    python bench/plot_shared_prefix.py docs/bench/shared_prefix_NVIDIA_H200.csv --out docs/bench

Needs matplotlib (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: the CSV's)")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(args.csv.open()))
    out = args.out or args.csv.parent
    out.mkdir(parents=True, exist_ok=True)
    shapes = [row["shape"] for row in rows]
    x = range(len(rows))
    width = 0.27

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    for offset, (key, label) in enumerate(
        (("bound", "bound T / C"), ("speedup_train", "training step"), ("speedup_logprob", "log-prob pass"))
    ):
        ax.bar([i + (offset - 1) * width for i in x], [float(r[key]) for r in rows], width, label=label)
    ax.set_xticks(list(x), shapes, rotation=20, ha="right")
    ax.set_ylabel("speed-up over packed (x)")
    ax.set_title("Shared-prefix speed-up against its bound")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{args.csv.stem}_speedup.png", dpi=120)

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    for offset, (key, label) in enumerate((("packed_train_peak_gib", "packed"), ("shared_train_peak_gib", "shared prefix"))):
        ax.bar([i + (offset - 0.5) * width for i in x], [float(r[key]) for r in rows], width, label=label)
    ax.set_xticks(list(x), shapes, rotation=20, ha="right")
    ax.set_ylabel("peak memory, training step (GiB)")
    ax.set_title("Peak memory per arm")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{args.csv.stem}_memory.png", dpi=120)
    print(f"wrote {out / (args.csv.stem + '_speedup.png')} and {out / (args.csv.stem + '_memory.png')}")


if __name__ == "__main__":
    main()
