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
    plots = {
        "speedup": ("speed-up over packed (x)", "Shared-prefix speed-up against its bound",
                    (("bound", "bound T / C"), ("speedup_train", "training step"), ("speedup_logprob", "log-prob pass"))),
        "memory": ("peak memory, training step (GiB)", "Peak memory per arm",
                   (("packed_train_peak_gib", "packed"), ("shared_train_peak_gib", "shared prefix"),
                    ("upstream_train_peak_gib", "upstream packed (missing: OOM)"))),
        "upstream": ("training step (ms)", "Training step: ours (packed, shared prefix) vs upstream transformers",
                     (("upstream_train_ms", "upstream packed (missing: OOM)"), ("packed_train_ms", "ours packed"),
                      ("shared_train_ms", "ours shared prefix"))),
    }
    width = 0.27
    for name, (ylabel, title, series) in plots.items():
        fig, ax = plt.subplots(figsize=(min(16, max(6, 0.8 * len(rows))), 4.5))
        series = [(key, label) for key, label in series if key in rows[0]]
        centre = (len(series) - 1) / 2
        for offset, (key, label) in enumerate(series):
            ax.bar([i + (offset - centre) * width for i in range(len(rows))],
                   [float(r[key] or "nan") for r in rows], width, label=label)
        ax.set_xticks(list(range(len(rows))), [row["shape"] for row in rows], rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{args.csv.stem}_{name}.png", dpi=120)
    print("wrote " + ", ".join(str(out / f"{args.csv.stem}_{name}.png") for name in plots))


if __name__ == "__main__":
    main()
