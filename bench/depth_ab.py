"""One-level batches planned as one level and as a prefix tree: the same plan, and the same step time.

    python bench/depth_ab.py [--layers 8] [--shapes 4x2048x256,8x4096x256,4x1024x256] [--rounds 8]
    python bench/depth_ab.py --tiny     # CPU run of the script itself

The tree planner (`shared_prefix_max_depth`, default 4) must not cost a batch with one level of sharing
anything. Per shape: the plans at `max_depth=1` and at the default depth are compared field by field
(nodes, compact length, every index; not the level-cost record), then the training step and the log-prob pass are timed A/B,
interleaved call by call in one process (`--rounds` rounds of one call per depth, the order flipped each
round), so that the host's drift and noise fall on both arms alike: the step-to-step noise of a host-bound
step across processes (about 30 % on the H200's host) is larger than any difference a planner could make.
Prints, per shape and pass, the two medians, their ratio (tree / one level) and the spread of the
per-round ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from patchgen.kernels.modeling.shared_prefix import observe_plans
from patchgen.kernels.shared_prefix import DEFAULT_MAX_DEPTH
from shared_prefix_arms import TINY, WIDTHS, logprob_pass, our_model, train_step
from shared_prefix_shapes import parse_shapes, shape_batch, tiny_shapes
from shared_prefix_timing import Timer


def plan_fields(plan) -> dict:
    """A plan as comparable values (tensors as lists; nested dataclasses by their repr of lists)."""

    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)

    # the level cost the planner charged is a record of the knob, not part of the layout
    return {f.name: plain(getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.name != "level_cost"}


def planned(model, fn, inputs) -> dict | None:
    plans = []
    with observe_plans(lambda plan, _: plans.append(plan)):
        fn(model, *inputs)
    return None if plans[-1] is None else plan_fields(plans[-1])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shapes", default="4x2048x256,8x4096x256,4x1024x256")
    parser.add_argument("--rounds", type=int, default=8, help="timed calls per depth (interleaved)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny widths, float32, on the CPU")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    widths = TINY if args.tiny else WIDTHS
    shapes = tiny_shapes("n4") if args.tiny else parse_shapes(args.shapes)
    model = our_model(widths, args.layers, device, torch.float32 if args.tiny else torch.bfloat16)
    model.config.shared_prefix_training = True
    model.config.shared_prefix_level_cost = None  # the device's measured figure, as a user gets it
    timer = Timer(device)
    depths = (1, DEFAULT_MAX_DEPTH)
    rows = []
    for shape in shapes:
        ids, cu, max_len, _ = shape_batch(shape, widths["vocab_size"], device)
        inputs = (ids, cu, max_len)
        fields = {}
        for depth in depths:
            model.config.shared_prefix_max_depth = depth
            fields[depth] = planned(model, train_step, inputs)
            for _ in range(args.warmup):
                train_step(model, *inputs)
                logprob_pass(model, *inputs)
        same = fields[depths[0]] == fields[depths[1]]
        for name, fn in (("train", train_step), ("logprob", logprob_pass)):
            times = {depth: [] for depth in depths}
            for r in range(args.rounds):
                for depth in depths if r % 2 == 0 else depths[::-1]:
                    model.config.shared_prefix_max_depth = depth
                    ms, _ = timer(lambda fn=fn, inputs=inputs: fn(model, *inputs))
                    times[depth].append(ms)
            one, tree = (statistics.median(times[d]) for d in depths)
            ratios = [b / a for a, b in zip(times[depths[0]], times[depths[1]])]
            row = dict(shape=shape[0], layers=args.layers, kind=name, same_plan=same, one_level_ms=one, tree_ms=tree,
                       ratio=tree / one, ratio_low=min(ratios), ratio_high=max(ratios), rounds=args.rounds)
            rows.append(row)
            print(
                f"{shape[0]} {args.layers}L {name}: plans equal {same}; max_depth=1 {one:.1f} ms, max_depth="
                f"{depths[1]} {tree:.1f} ms, ratio {tree / one:.3f} (per round {min(ratios):.3f}-{max(ratios):.3f}, "
                f"{args.rounds} rounds)",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
