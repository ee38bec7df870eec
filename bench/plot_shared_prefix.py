"""PNG plots of a `bench/shared_prefix_gpu.py` CSV, one panel per depth (layers).

    python bench/plot_shared_prefix.py docs/bench/shared_prefix_NVIDIA_H200.csv --out docs/bench

`_efficiency`: training-step and log-prob efficiency (speed-up over packed / bound T/C) per shape,
with the issue's targets; `_graphs`: the same under CUDA graphs (a `--graphs` run), the log-prob pass as one call
and with its plan reused; `_host_gpu`: host vs GPU ms of the training step, packed and shared;
`_upstream`: training step of the baselines (transformers + liger + fla, transformers + fla) vs ours;
`_memory`: peak memory per arm. Needs matplotlib (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

PLOTS = {
    "efficiency": (
        "efficiency (speed-up / bound T/C)",
        "Shared prefix: efficiency against its bound",
        (("efficiency_train", "training step"), ("efficiency_logprob", "log-prob pass")),
    ),
    "graphs": (
        "efficiency (speed-up / bound T/C)",
        "Shared prefix under CUDA graphs (shared_prefix_cuda_graphs): efficiency against its bound",
        (
            ("efficiency_shared_graphs_train", "training step"),
            ("efficiency_shared_graphs_logprob", "log-prob pass, one call"),
            ("efficiency_shared_graphs_logprob_reuse", "log-prob pass, plan reused"),
        ),
    ),
    "host_gpu": (
        "training step, ms",
        "Training step: host vs GPU ms (GPU-bound: host < GPU)",
        (
            ("packed_host_ms", "packed: host"),
            ("packed_gpu_ms", "packed: GPU"),
            ("shared_host_ms", "shared: host"),
            ("shared_gpu_ms", "shared: GPU"),
        ),
    ),
    "upstream": (
        "training step, ms",
        "Training step: ours vs transformers (+ liger), same weights",
        (
            ("upstream_liger_train_ms", "transformers + liger + fla"),
            ("upstream_train_ms", "transformers + fla"),
            ("packed_train_ms", "ours packed"),
            ("shared_train_ms", "ours shared prefix"),
        ),
    ),
    "memory": (
        "peak memory, training step (GiB)",
        "Peak memory per arm",
        (
            ("packed_train_peak_gib", "ours packed"),
            ("shared_train_peak_gib", "ours shared prefix"),
            ("upstream_liger_train_peak_gib", "transformers + liger + fla"),
        ),
    ),
}
TARGETS = {name: ((0.9, "target, P >= 2048"), (0.8, "target, P = 1024")) for name in ("efficiency", "graphs")}


def value(row, key) -> float:
    try:
        return float(row.get(key) or "nan")
    except ValueError:
        return float("nan")


def by_depth(rows) -> dict[str, list[dict]]:
    """Rows per depth, in the CSV's order (a CSV from before the `layers` column is one depth)."""
    depths: dict[str, list[dict]] = {}
    for row in rows:
        depths.setdefault(row.get("layers") or "?", []).append(row)
    return depths


def present(rows, name) -> list[tuple[str, str]]:
    """The series of plot `name` that the CSV has values for (a plot with none is not drawn)."""
    return [(key, label) for key, label in PLOTS[name][2] if any(row.get(key, "") != "" for row in rows)]


def draw(rows, name, out: Path, stem: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ylabel, title, _ = PLOTS[name]
    series = present(rows, name)
    if not series:
        return None
    depths = by_depth(rows)
    width = 0.8 / len(series)
    longest = max(len(group) for group in depths.values())
    fig, axes = plt.subplots(
        len(depths), 1, figsize=(min(18, max(7, 0.7 * longest)), 4.2 * len(depths)), squeeze=False
    )
    for ax, (layers, group) in zip(axes[:, 0], depths.items()):
        centre = (len(series) - 1) / 2
        for offset, (key, label) in enumerate(series):
            ax.bar(
                [i + (offset - centre) * width for i in range(len(group))],
                [value(r, key) for r in group],
                width,
                label=label,
            )
        for level, label in TARGETS.get(name, ()):
            ax.axhline(level, linestyle="--", linewidth=1, color="grey")
            ax.text(-0.5, level, label, ha="left", va="bottom", fontsize=8, color="grey")
        ax.set_xticks(
            list(range(len(group))), [r["shape"] for r in group], rotation=25, ha="right", fontsize=8
        )
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, {layers} layers" if layers != "?" else title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{stem}_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: the CSV's)")
    args = parser.parse_args(argv)
    rows = list(csv.DictReader(args.csv.open()))
    if not rows:
        raise SystemExit(f"{args.csv} has no rows: run bench/shared_prefix_gpu.py first")
    out = args.out or args.csv.parent
    out.mkdir(parents=True, exist_ok=True)
    written = [path for name in PLOTS if (path := draw(rows, name, out, args.csv.stem))]
    print("wrote " + ", ".join(str(p) for p in written))
    return written


if __name__ == "__main__":
    main()
