"""Measure what one more level of a shared-prefix tree costs on this device, in rows of compact-row work.

    python bench/level_cost.py [--layers 32] [--trees 2,4,8] [--repeats 5] [--write]
    python bench/level_cost.py --tiny          # CPU run of the script itself (tiny widths; never written)
    python bench/level_cost.py --from-log RUN.txt --env-log ENV.txt [--write]  # fit a run's printed points

Times the training step (forward + backward, activation checkpointing, as `shared_prefix_gpu.py`) of
the generated `Qwen3_5ForCausalLM` at Qwen3.5-4B widths, bf16, on 3-turn agentic batches (`--trees`
prompts of 8 rollouts: P = 1024, two shared turns of 256 branching in two, 256 own tokens each)
planned at max_depth 1, 2 and 3 with no level cost, so every depth is taken; the same batch is
then one, two or three levels deep with fewer compact rows C the deeper it goes, and more trees
give more rows at each depth. A least-squares fit `step ms = a + b * C + c * levels` over every
(trees, depth) point separates the two: `b` is the cost of a compact row, `c` that of a level
(its GDN round in every linear-attention layer, gathers, launches and plan-building time), and
`c / b` is the per-level cost in rows that the plan builder charges (`shared_prefix_level_cost`).
The fit, its standard errors and residuals are printed; `--write` records the figure with how it
was measured under this device's name in `kernels/shared_prefix/level_costs.json`, the table
`build_plan` reads (it never times anything itself, so every rank builds the same plan).
`--from-log` fits the points a device run printed (its table, header line first), for a run cut by
its time cap before the fit: the device, layers and versions come from that run's own logs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from patchgen.kernels.modeling.shared_prefix import observe_plans
from patchgen.kernels.shared_prefix import level_cost as table
from shared_prefix_arms import TINY, WIDTHS, our_model, train_step
from shared_prefix_shapes import batch
from shared_prefix_timing import Timer

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (3 linear + 1 full per 4)")
    parser.add_argument("--trees", default="2,4,8", help="agentic prompts per micro-batch, comma-separated")
    parser.add_argument("--depths", default="1,2,3", help="max_depth of the plans, comma-separated")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per point")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per point (the median is fitted)")
    parser.add_argument("--write", action="store_true", help="record the figure in the per-device table")
    parser.add_argument("--table", type=Path, default=table.TABLE, help="the table --write updates")
    parser.add_argument("--tiny", action="store_true", help="tiny widths and shapes, float32, on the CPU")
    parser.add_argument("--from-log", type=Path, help="fit the points of this printed run instead of timing")
    parser.add_argument(
        "--env-log",
        type=Path,
        help="with --from-log: that run's bench/gpu_env.sh output (the versions it ran)",
    )
    args = parser.parse_args(argv)
    if args.from_log and args.tiny:
        raise SystemExit("--from-log fits a device run's points; --tiny times the script on the CPU")
    args.trees = _ints(args.trees, "--trees")
    args.depths = _ints(args.depths, "--depths")
    if len(args.trees) < 2 or len(args.depths) < 2:
        raise SystemExit(
            "--trees and --depths need two values or more each: the fit separates rows from levels"
        )
    if args.write and args.tiny:
        raise SystemExit("--write records the real widths' figure; a --tiny run is a test of the script")
    return args


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise SystemExit(f"{flag}: cannot read {text!r}; give positive whole numbers, comma-separated")
    return values


def agentic(trees: int, tiny: bool, vocab: int, device):
    """`trees` prompts, each branching in two after the prompt and after each of two shared turns (8 rollouts)."""
    prompt, turn, own = (64, 64, 4) if tiny else (1024, 256, 256)
    ids, cu, max_len, _ = batch([(8, prompt, own)] * trees, [], vocab, device, seed=trees, turns=(turn, turn))
    return ids, cu, max_len


def measure_point(model, ids, cu, max_len, depth, args, timer) -> dict:
    model.config.shared_prefix_max_depth = depth
    model.config.shared_prefix_level_cost = 0  # every depth up to max_depth is taken
    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        for _ in range(args.warmup):
            timer(lambda: train_step(model, ids, cu, max_len))
    plan = plans[-1]
    times = [timer(lambda: train_step(model, ids, cu, max_len))[0] for _ in range(args.repeats)]
    model.zero_grad(set_to_none=True)
    return {
        "depth": depth,
        "levels": plan.depth,
        "T": plan.packed_length,
        "C": plan.compact_length,
        "ms": statistics.median(times),
        "spread_ms": max(times) - min(times),
    }


def fit(points: list[dict]) -> dict:
    """Least squares `ms = a + b * C + c * levels`, with standard errors from the residuals."""
    x = np.array([[1.0, p["C"], p["levels"]] for p in points])
    y = np.array([p["ms"] for p in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residuals = y - x @ coef
    dof = max(len(points) - 3, 1)
    covariance = np.linalg.pinv(x.T @ x) * float(residuals @ residuals) / dof
    a, b, c = (float(v) for v in coef)
    sa, sb, sc = (float(v) for v in np.sqrt(np.maximum(np.diag(covariance), 0)))
    if b <= 2 * sb:  # not measurably above zero: the ratio c / b would be noise
        raise SystemExit(
            f"the fit gives {b:.3g} ms (se {sb:.2g}) per compact row: the step does not grow measurably with "
            "its rows (host-bound?); time more rows (--trees), more layers or more --repeats"
        )
    return {
        "intercept_ms": a,
        "us_per_row": 1e3 * b,
        "us_per_row_se": 1e3 * sb,
        "ms_per_level": c,
        "ms_per_level_se": sc,
        "intercept_se_ms": sa,
        "level_cost_rows": max(0, round(c / b)),
        "residuals_ms": [round(float(r), 3) for r in residuals],
    }


def provenance(args, device, dtype) -> dict:
    def version(module: str) -> str | None:
        try:
            return __import__(module).__version__
        except ImportError:
            return None

    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True
    ).stdout.strip()
    return {
        "command": " ".join(["python bench/level_cost.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": table.device_name(device),
        "model": f"Qwen3_5ForCausalLM, {'tiny' if args.tiny else 'Qwen3.5-4B'} widths, {args.layers} layers, "
        f"{str(dtype).removeprefix('torch.')}, activation checkpointing, training step (forward + backward)",
        "batches": f"3-turn agentic, {args.trees} prompts x 8 rollouts, max_depth {args.depths}",
        "patchgen_commit": commit or None,
        "torch": torch.__version__,
        "triton": version("triton"),
        "fla": version("fla"),
        "python": platform.python_version(),
    }


def write(path: Path, name: str, entry: dict) -> None:
    data = json.loads(path.read_text())
    data.setdefault("devices", {})[name] = entry
    data["devices"] = dict(sorted(data["devices"].items()))
    path.write_text(json.dumps(data, indent=2) + "\n")


HEADER = re.compile(
    r"^(?P<device>.+): (?P<layers>\d+) layers, torch\.(?P<dtype>\w+), training step; median of (?P<repeats>\d+)$"
)
POINT = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s*$")


def read_log(text: str) -> tuple[dict, list[dict]]:
    """The header and the (trees, depth) points a run printed, in the order it printed them."""
    header = next((m.groupdict() for m in map(HEADER.match, text.splitlines()) if m), None)
    if header is None:
        raise SystemExit(
            "--from-log: no header line ('<device>: N layers, torch.<dtype>, training step; ...')"
        )
    points = []
    for m in filter(None, map(POINT.match, text.splitlines())):
        trees, depth, levels, t, c = (int(v) for v in m.groups()[:5])
        points.append(
            {
                "trees": trees,
                "depth": depth,
                "levels": levels,
                "T": t,
                "C": c,
                "ms": float(m.group(6)),
                "spread_ms": float(m.group(7)),
            }
        )
    if len({p["levels"] for p in points}) < 2 or len(points) < 4:
        raise SystemExit(f"--from-log: {len(points)} points over too few depths to fit a level's cost")
    return header, points


def versions_from(env_text: str) -> dict:
    """torch / triton / transformers as bench/gpu_env.sh printed them; triton 3.7.1 when it was staged."""
    found = dict(
        re.findall(r"\b(torch|triton|transformers) (\S+)", env_text.splitlines()[0] if env_text else "")
    )
    staged = re.search(r"on request: triton (\S+)", env_text or "")
    if staged:  # bench/step_run.sh puts the staged Triton first on the path
        found["triton"] = staged.group(1)
    return found


def from_log(args) -> None:
    if not args.from_log.is_file():
        raise SystemExit(
            f"--from-log: no file {args.from_log}; give the level part's printed output (level_cost.txt)"
        )
    header, points = read_log(args.from_log.read_text())
    result = fit(points)
    say(result)
    if args.write:
        env = versions_from(args.env_log.read_text() if args.env_log else "")
        entry = {
            "level_cost_rows": result["level_cost_rows"],
            "command": " ".join(["python bench/level_cost.py", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "device": header["device"],
            "model": f"Qwen3_5ForCausalLM, Qwen3.5-4B widths, {header['layers']} layers, {header['dtype']}, "
            "activation checkpointing, training step (forward + backward)",
            "batches": f"3-turn agentic, {sorted({p['trees'] for p in points})} prompts x 8 rollouts, "
            f"max_depth {sorted({p['depth'] for p in points})}; {len(points)} points, median of {header['repeats']}",
            "fitted_from": f"the points printed by a device run ({args.from_log.name})",
            **env,
            "fit": result,
            "points": points,
        }
        write(args.table, entry["device"], entry)
        print(f"written to {args.table} under {entry['device']!r}")


def say(result: dict) -> None:
    print(
        f"fit: ms = {result['intercept_ms']:.2f} + {result['us_per_row']:.3f} us * C (se {result['us_per_row_se']:.3f})"
        f" + {result['ms_per_level']:.2f} ms * levels (se {result['ms_per_level_se']:.2f})"
    )
    print(f"residuals ms: {result['residuals_ms']}")
    print(f"per-level cost: {result['level_cost_rows']} rows of compact-row work (shared_prefix_level_cost)")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.from_log:
        return from_log(args)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit(
            "no CUDA device: the figure is measured on the accelerator (--tiny runs the script on the CPU)"
        )
    dtype = torch.float32 if args.tiny else torch.bfloat16
    widths = TINY if args.tiny else WIDTHS
    model = our_model(widths, args.layers, device, dtype)
    model.config.shared_prefix_training = True
    timer = Timer(device)
    print(
        f"{table.device_name(device)}: {args.layers} layers, {dtype}, training step; median of {args.repeats}"
    )
    print(f"{'trees':>5} {'max_depth':>9} {'levels':>6} {'T':>7} {'C':>7} {'ms':>9} {'spread':>7}")
    points = []
    for trees in args.trees:
        ids, cu, max_len = agentic(trees, args.tiny, widths["vocab_size"], device)
        for depth in args.depths:
            point = {"trees": trees, **measure_point(model, ids, cu, max_len, depth, args, timer)}
            points.append(point)
            print(
                f"{trees:>5} {depth:>9} {point['levels']:>6} {point['T']:>7} {point['C']:>7}"
                f" {point['ms']:>9.2f} {point['spread_ms']:>7.2f}",
                flush=True,
            )
    if len({p["levels"] for p in points}) < 2:
        raise SystemExit("every plan has the same depth: nothing to fit a level's cost to")
    result = fit(points)
    say(result)
    if args.write:
        entry = {
            "level_cost_rows": result["level_cost_rows"],
            **provenance(args, device, dtype),
            "fit": result,
        }
        entry["points"] = points
        write(args.table, entry["device"], entry)
        print(f"written to {args.table} under {entry['device']!r}")


if __name__ == "__main__":
    main()
