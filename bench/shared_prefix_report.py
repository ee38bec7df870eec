"""The report of `bench/shared_prefix_gpu.py`: derived columns, the CSV, and a markdown table per depth."""

from __future__ import annotations

import csv
import math
from pathlib import Path

BASELINE_ARMS = ("upstream", "upstream_liger")


def ratios(row):
    """Speed-up, efficiency (speed-up / bound T/C), ours packed vs each baseline, memory ratios."""
    for kind in ("train", "logprob"):
        if f"packed_{kind}_ms" not in row:  # a baseline-only run: merged with ours afterwards
            continue
        if f"shared_{kind}_ms" in row:
            row[f"speedup_{kind}"] = row[f"packed_{kind}_ms"] / row[f"shared_{kind}_ms"]
            row[f"efficiency_{kind}"] = row[f"speedup_{kind}"] / row["bound"]
        for base in BASELINE_ARMS:
            if f"{base}_{kind}_ms" in row:
                row[f"packed_vs_{base}_{kind}"] = row[f"{base}_{kind}_ms"] / row[f"packed_{kind}_ms"]
    for arm in ("packed", "shared", *BASELINE_ARMS):
        if f"{arm}_gpu_ms" in row and f"{arm}_train_ms" in row:
            # of the timed step's wall, the share the GPU was busy (1 - this: idle, waiting for the host)
            row[f"{arm}_gpu_busy"] = row[f"{arm}_gpu_ms"] / row[f"{arm}_train_ms"]
    if "shared_train_peak_gib" in row and "packed_train_peak_gib" in row:
        row["memory_ratio_train"] = row["shared_train_peak_gib"] / row["packed_train_peak_gib"]
        row["step_memory_ratio_train"] = row["shared_train_step_gib"] / row["packed_train_step_gib"]
    if "shared_train_activation_gib" in row and "packed_train_activation_gib" in row:
        # weights and gradients are the same in both arms and set a floor under the total peak; the activations
        # (and workspaces) are what prefix sharing can cut
        row["activation_memory_ratio_train"] = row["shared_train_activation_gib"] / row["packed_train_activation_gib"]


def write(rows, path: Path):
    if not rows:
        return
    fields = list(
        dict.fromkeys(key for row in rows for key in row)
    )  # first-seen order; error columns are rare
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _num(row, key, fmt="{:.0f}"):
    value = row.get(key)
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        error = str(row.get(key[: -len("_ms")] + "_error", "")) if key.endswith("_ms") else ""
        return "OOM" if error.startswith("OutOfMemory") else ("error" if error else "-")
    return fmt.format(float(value))


def table(rows, baselines=BASELINE_ARMS) -> str:
    """Markdown: one line per shape, the columns the issue's targets read."""
    present = [b for b in baselines if any(f"{b}_train_ms" in r for r in rows)]
    head = [
        "shape",
        "layers",
        "T",
        "C",
        "bound",
        "packed ms",
        "shared ms",
        "eff train / logprob",
        "host / GPU ms packed",
        "host / GPU ms shared",
        "peak GiB packed → shared",
        "loss, log-probs bit-equal",
    ]
    for base in present:
        head += [f"{base} ms", f"ours packed vs {base}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            str(r["shape"]),
            str(r.get("layers", "")),
            str(r["T"]),
            str(r["C"]),
            f"{float(r['bound']):.2f}",
            _num(r, "packed_train_ms"),
            _num(r, "shared_train_ms"),
            f"{_num(r, 'efficiency_train', '{:.2f}')} / {_num(r, 'efficiency_logprob', '{:.2f}')}",
            f"{_num(r, 'packed_host_ms')} / {_num(r, 'packed_gpu_ms')}",
            f"{_num(r, 'shared_host_ms')} / {_num(r, 'shared_gpu_ms')}",
            f"{_num(r, 'packed_train_peak_gib', '{:.1f}')} → {_num(r, 'shared_train_peak_gib', '{:.1f}')}",
            f"{r.get('loss_bitequal', '-')}, {r.get('logprobs_bitequal', '-')}",
        ]
        for base in present:
            cells += [_num(r, f"{base}_train_ms"), _num(r, f"packed_vs_{base}_train", "{:.2f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
