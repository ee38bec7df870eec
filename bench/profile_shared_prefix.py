"""Where a training step's (or log-prob pass's) time goes, packed vs shared prefix: a torch.profiler table per arm (GPU).

    python bench/profile_shared_prefix.py [--shapes 4x1024x256,8x4096x256] [--layers 8]
    python bench/profile_shared_prefix.py --pass logprob --groups --shapes 8x4096x256,4x2048x256
    python bench/profile_shared_prefix.py --pass logprob --graphs --timeline --shapes 4x2048x256 --layers 32

Same model and batches as `bench/shared_prefix_gpu.py`. Per shape and arm: the step's wall time,
the GPU's busy time (sum of kernel times; wall minus busy is launch-bound idling), host syncs,
the first call's time (compilation and autotuning) and the top kernels and host ops. `--pass logprob`
profiles the log-prob pass (`shared_prefix_arms.logprob_pass`) instead of the training step; `--groups`
adds, per shape, the kernel time of each op group packed vs shared and what the shared pass spends beyond
`C / T` of the packed one (`kernel_groups.py`: the groups of the CPU accounting in `scoring_work.py`).
`--graphs` runs the shared arm with `shared_prefix_cuda_graphs` (checkpointing off for it); `--timeline` adds,
per arm, the host phases of the profiled call and the device's idle gaps against them (`pass_timeline.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import time

import torch
from kernel_groups import heaviest_excess
from kernel_groups import table as group_table
from pass_timeline import phases, report, timeline
from patchgen.kernels.modeling.layer_graphs import use_graphs
from patchgen.kernels.modeling.shared_prefix import observe_plans
from shared_prefix_arms import MODULE, WIDTHS, checkpointed, config_for, logprob_pass, train_step
from shared_prefix_graphs import uncheckpointed
from shared_prefix_shapes import parse_shapes, shape_batch, tree_settings
from shared_prefix_timing import count_syncs, events_of
from torch.profiler import ProfilerActivity, profile


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x1024x256,8x4096x256")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=14, help="table rows per arm")
    parser.add_argument("--pass", dest="which", choices=("train", "logprob"), default="train",
                        help="the training step (default) or the log-prob pass (forward under no_grad)")
    parser.add_argument("--groups", action="store_true", help="kernel time per op group, packed vs shared")
    parser.add_argument("--graphs", action="store_true", help="the shared arm under shared_prefix_cuda_graphs")
    parser.add_argument("--timeline", action="store_true", help="host phases and device idle gaps per arm")
    args = parser.parse_args(argv)
    run = train_step if args.which == "train" else logprob_pass

    torch.manual_seed(0)
    module = importlib.import_module(MODULE)
    with torch.device("cuda"):
        model = module.Qwen3_5ForCausalLM(config_for(WIDTHS, args.layers)).bfloat16()
    checkpointed(model)
    model.train()
    for shape in parse_shapes(args.shapes):
        name = shape[0]
        ids, cu, max_len, _ = shape_batch(shape, WIDTHS["vocab_size"], "cuda")
        tree = tree_settings(shape)
        model.config.shared_prefix_max_depth = tree["max_depth"]
        model.config.shared_prefix_level_cost = tree["level_cost"]
        per_kernel, compact = {}, {}

        def note(plan, packed_tokens, into=compact):  # called on the shared arm only (the packed one plans nothing)
            into.update(C=plan.compact_length if plan is not None else packed_tokens, T=packed_tokens)

        for flag in (False, True):
            model.config.shared_prefix_training = flag
            graphed = flag and args.graphs
            model.config.shared_prefix_cuda_graphs = graphed
            (uncheckpointed if graphed else checkpointed)(model)
            step = functools.partial(run, model, ids, cu, max_len)
            first = wall_ms(step)
            steady = min(wall_ms(step) for _ in range(3))
            syncs = count_syncs(model, run, ids, cu, max_len, torch.device("cuda"))
            labelled = phases(module) if args.timeline else contextlib.nullcontext()
            with observe_plans(note), labelled, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.self_device_time_total for e in kernels) / 1e3  # kernel rows only: ops would count twice
            launches = sum(e.count for e in kernels)
            arm = ("shared, graphs" if graphed else "shared") if flag else "packed"
            per_kernel["shared" if flag else "packed"] = {e.key: e.self_device_time_total for e in kernels}
            print(f"\n=== {name} {arm}: first call {first:.0f} ms, step {steady:.1f} ms, GPU busy {busy:.1f} ms, "
                  f"{launches} kernels, {syncs} syncs")
            print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows // 2, max_name_column_width=60))
            if args.timeline:
                print(report(timeline(events_of(prof)), f"{name} {arm} {args.which} timeline"))
            if graphed:
                model.config.shared_prefix_cuda_graphs = False
                use_graphs(model.model, None)
                checkpointed(model)
        if args.groups:
            print(f"\n=== {name} {args.which}: kernel time per op group")
            if "C" in compact:
                print(group_table(per_kernel["packed"], per_kernel["shared"], compact["C"] / compact["T"]))
                print(heaviest_excess(per_kernel["packed"], per_kernel["shared"], compact["C"] / compact["T"]))
            else:
                print("  the shared arm built no plan (nothing shared): no bound to compare against")
    model.config.shared_prefix_training = False


if __name__ == "__main__":
    main()
