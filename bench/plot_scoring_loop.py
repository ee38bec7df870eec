"""A PNG of the eager scoring loop's efficiency per shape, one bar per run, from `bench/scoring_loop.py` outputs.

    python bench/plot_scoring_loop.py --out docs/bench/scoring_loop_NVIDIA_H200_l32_efficiency.png \\
        "neither graph=docs/bench/scoring_loop_NVIDIA_H200_l32_no_call_graphs.txt" \\
        "op call graphs=docs/bench/scoring_loop_NVIDIA_H200_l32_call_graphs.txt" ...

Each run is `LABEL=PATH` of a loop's printed output; its result lines (`[32L] n=4 P=2048 R=256 ... | host rows: ...
eff 0.89 | ...`) give the efficiency = (packed / shared) / (T / C) of the rows handed over on the host (the product's
path, `--rows device` for the others), drawn per shape against issue 15's targets (0.90 at P >= 2048, 0.80 at
P = 1024), and beside it the shared pass's ms a micro-batch. Needs matplotlib (`pip install -e '.[bench]'`); the parsing does not.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

RESULT = re.compile(
    r"^\[(?P<layers>\d+)L\] (?P<shape>n=\d+ P=\d+ R=\d+).*?"
    r"device rows: packed (?P<device_packed>[\d.]+) / shared (?P<device_shared>[\d.]+) ms .*?eff (?P<device_eff>[\d.]+)"
    r" \| host rows: packed (?P<host_packed>[\d.]+) / shared (?P<host_shared>[\d.]+) ms .*?eff (?P<host_eff>[\d.]+)"
)
TARGETS = ((0.90, "target at P >= 2048"), (0.80, "target at P = 1024"))


def results(text: str) -> list[dict]:
    """The loop's result lines: depth, shape, and per row kind (host, device) packed and shared ms and efficiency."""
    found = []
    for line in text.splitlines():
        match = RESULT.match(line.strip())
        if match:
            row = {key: float(value) for key, value in match.groupdict().items() if key not in ("layers", "shape")}
            found.append({"layers": int(match["layers"]), "shape": match["shape"], **row})
    return found


def _prompt_then_rollouts(shape: str) -> tuple[int, int]:
    fields = dict(part.split("=") for part in shape.split())
    return int(fields["P"]), int(fields["n"])


def runs(specs: list[str]) -> list[tuple[str, list[dict]]]:
    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"{spec!r}: give each run as LABEL=PATH")
        found = results(Path(path).read_text())
        if not found:
            raise SystemExit(f"{path}: no result lines of bench/scoring_loop.py in it")
        out.append((label, found))
    return out


def draw(labelled: list[tuple[str, list[dict]]], out: Path, rows: str, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for _, found in labelled for r in found}, key=_prompt_then_rollouts)
    width = 0.8 / len(labelled)
    # the shared pass's own ms beside the efficiency: packed's ms moves between calls where it is host-bound too
    # (P = 1024), and the efficiency with it
    fig, (eff, ms) = plt.subplots(1, 2, figsize=(3.4 * len(shapes) + 3, 4.4), width_ratios=(3, 2))
    for panel, column, fmt in ((eff, "eff", "%.2f"), (ms, "shared", "%.0f")):
        for i, (label, found) in enumerate(labelled):
            by_shape = {r["shape"]: r[f"{rows}_{column}"] for r in found}
            xs = [k + (i - (len(labelled) - 1) / 2) * width for k, s in enumerate(shapes) if s in by_shape]
            bars = panel.bar(xs, [by_shape[s] for s in shapes if s in by_shape], width, label=label)
            panel.bar_label(bars, fmt=fmt, fontsize=7)
        panel.set_xticks(range(len(shapes)), [s.replace(" R", "\nR") for s in shapes], fontsize=8)
    for value, label in TARGETS:
        eff.axhline(value, linestyle="--", linewidth=0.8, color="grey")
        eff.annotate(label, (-0.45, value), fontsize=7, ha="left", va="bottom", color="grey")
    eff.set_ylabel(f"efficiency, rows on the {rows} (speed-up / bound T/C)", fontsize=8)
    eff.legend(fontsize=7, loc="lower right")
    ms.set_ylabel("shared ms a micro-batch (lower is faster)", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH of a scoring_loop.py output")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--rows", choices=("host", "device"), default="host")
    parser.add_argument("--title", default="Eager scoring loop: efficiency against its bound")
    args = parser.parse_args(argv)
    return draw(runs(args.runs), Path(args.out), args.rows, args.title)


if __name__ == "__main__":
    print(main())
