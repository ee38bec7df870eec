"""Plan building, an older builder against this one, interleaved call by call in one process (CPU time).

    git archive <commit> kernels | tar -x -C /tmp/before && mv /tmp/before/kernels /tmp/before/kbase
    python bench/plan_build_ab.py --before /tmp/before [--repeats 60] [--positions none mrope shifted stepped stepped_compared]
    python bench/plan_build_ab.py --before /tmp/before --shapes 4x2048x256,8x4096x256,system-tree,agentic,agentic-4 --pad

On a host shared with other jobs the wall clock is mostly waiting for a core; the CPU time of the
building thread, measured for both builders in the same conditions (alternating calls), is what
compares them. Both plans are checked equal (nodes, compact and expand indices, positions) first.
Prints the median and the smallest CPU ms and the median wall ms per batch (the 64k-token batches of
`plan_build.py`) at max_depth 1 and 4, for each kind of position rows asked for, and the load average.
`--shapes`: the GPU bench's shapes instead (`shared_prefix_shapes.py`: their batches, per-sequence positions
on the host as the model builds them, their tree settings); `--pad`: each batch also padded to bucket counts
(`pad_to_bucket=True`, as a CUDA-graphed step builds it), the padded plans of both builders checked equal too.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import statistics
import sys
import time

import numpy as np
import torch
from patchgen.kernels.shared_prefix import build_plan as after
from plan_build import agentic_batch, grpo_batch, mrope
from shared_prefix_shapes import parse_shapes, shape_batch, tree_settings

BATCHES = {
    "64k: 8 prompts x 8, P~500, R~500": lambda: grpo_batch(8, 8, (400, 600), (256, 768), seed=2),
    "64k: 1 prompt x 8, P=7680, R=512": lambda: grpo_batch(1, 8, (7680, 7680), (512, 512), seed=12),
    "64k: 64 prompts x 4, P~200, R~50": lambda: grpo_batch(64, 4, (150, 250), (10, 90), seed=3),
    "64k: 128 prompts x 4, P=96, R=32 (512 seqs)": lambda: grpo_batch(128, 4, (96, 96), (32, 32), seed=14),
    "64k: 128 system + 64 prompts x 4, P=R=64": lambda: grpo_batch(64, 4, (64, 64), (64, 64), system_len=128, seed=15),
    "70k: 512 system + 8 prompts x 8, P~200": lambda: grpo_batch(8, 8, (150, 250), (256, 512), system_len=512, seed=7),
    "64k: 8 agentic trees, 3 turns x 2": lambda: agentic_batch(512, (128, 128), 256, rollouts_of=8, seed=8),
}


def same_plan(a, b) -> bool:
    """Every field of the two plans equal: nodes, every index tensor of every mixer, the layout."""
    return _same(a, b)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        names = [f.name for f in dataclasses.fields(a)]
        return names == [f.name for f in dataclasses.fields(b)] and all(
            _same(getattr(a, n), getattr(b, n)) for n in names
        )
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def alternating_ms(builders: dict, call, repeats: int) -> tuple[dict, str]:
    """`call(builder)` for each builder in turn, `repeats` rounds: CPU ms per builder, and a line of the median
    (smallest) CPU ms and median wall ms of each."""
    cpu, wall = {label: [] for label in builders}, {label: [] for label in builders}
    for _ in range(repeats):
        for label, fn in builders.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            call(fn)
            cpu[label].append(1e3 * (time.thread_time() - start_cpu))
            wall[label].append(1e3 * (time.perf_counter() - start))
    shown = "  ".join(
        f"{k} {statistics.median(cpu[k]):5.2f} ({min(cpu[k]):5.2f}) {statistics.median(wall[k]):6.2f}" for k in cpu
    )
    return cpu, shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a folder holding the older `kernels` package as `kbase`")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument(
        "--positions",
        nargs="+",
        choices=("none", "mrope", "shifted", "stepped", "stepped_compared"),
        default=["none"],
        help="stepped_compared: the stepped rows with the check for rows that are one function of the "
        "offset turned off in this builder, so they are grouped by comparing the rows (the path of rows "
        "that differ between prompts, e.g. image grids)",
    )
    parser.add_argument("--shapes", help="shapes of shared_prefix_shapes.py (comma-separated) instead of the 64k batches")
    parser.add_argument("--pad", action="store_true", help="also time the plans padded to bucket counts")
    args = parser.parse_args()
    sys.path.insert(0, args.before)
    before = importlib.import_module("kbase.shared_prefix").build_plan
    plan_module = importlib.import_module("patchgen.kernels.shared_prefix.plan")
    offset_rows = getattr(plan_module, "offset_rows", None)
    torch.set_num_threads(1)
    if args.shapes:
        shapes_ab(before, args)
        return
    for kind in args.positions:
        print(f"median (smallest) CPU ms, median wall ms, of {args.repeats} alternating calls; positions {kind}")
        print("load average", " ".join(f"{v:.1f}" for v in os.getloadavg()))
        for name, make in BATCHES.items():
            ids, cu = make()
            pos = None
            if kind != "none":
                pos = mrope(cu, ids.shape[1])
                if kind in ("shifted", "stepped", "stepped_compared"):
                    pos[1] += 1  # as plan_build.py's [3,1,T]* and [3,1,T]~ rows
                if kind in ("stepped", "stepped_compared"):
                    pos[2] += (pos[0] % 4 == 0).long()
            if offset_rows is not None:
                plan_module.offset_rows = (lambda *a: None) if kind == "stepped_compared" else offset_rows
            for depth in (1, 4):
                old, new = before(ids, cu, pos, max_depth=depth), after(ids, cu, pos, max_depth=depth)
                if not same_plan(old, new):
                    raise SystemExit(f"{name}, max_depth {depth}, positions {kind}: the two builders disagree")
                _, shown = alternating_ms(
                    {"before": before, "after": after}, lambda fn, ids=ids, cu=cu, pos=pos, depth=depth: fn(ids, cu, pos, max_depth=depth), args.repeats
                )
                print(f"{name:<44} max_depth {depth} levels {new.depth}  {shown}", flush=True)
        print("load average", " ".join(f"{v:.1f}" for v in os.getloadavg()))


def shapes_ab(before, args) -> None:
    """The GPU bench's shapes, unpadded (and padded with `--pad`), both builders alternating call by call."""
    from patchgen.kernels.shared_prefix import positions_from_cu_seqlens

    pads = (False, True) if args.pad else (False,)
    print(f"median (smallest) CPU ms, median wall ms, of {args.repeats} alternating calls; per-sequence positions")
    print("load average", " ".join(f"{v:.1f}" for v in os.getloadavg()))
    for shape in parse_shapes(args.shapes):
        ids, cu, _, _ = shape_batch(shape, 512, "cpu")
        pos = positions_from_cu_seqlens(cu, ids.shape[1])
        kwargs = {"conv_kernel_size": 4, "min_prefix": 64, **tree_settings(shape)}
        for pad in pads:
            def run(fn, ids=ids, cu=cu, pos=pos, pad=pad, kwargs=kwargs):
                return fn(ids, cu, pos, pad_to_bucket=pad, **kwargs)

            old, new = run(before), run(after)
            if not same_plan(old, new):
                raise SystemExit(f"{shape.name}, pad_to_bucket={pad}: the two builders disagree")
            cpu, shown = alternating_ms({"before": before, "after": after}, run, args.repeats)
            ratio = statistics.median(cpu["before"]) / statistics.median(cpu["after"])
            print(f"{shape.name:<52} T {ids.shape[1]:>6} {'padded' if pad else 'plain':>6}  {shown}  x{ratio:.2f}",
                  flush=True)
    print("load average", " ".join(f"{v:.1f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
