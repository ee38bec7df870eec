"""Where the host's time goes in one training step: CPU time vs GPU time, and the Python hot spots (GPU).

    python bench/host_profile.py [--shapes 4x2048x256] [--layers 8,32] [--pass train|logprob] [--top 30] [--out DIR]

Same model and batches as `bench/shared_prefix_gpu.py`. The CUDA context is made with blocking
synchronisation (`CU_CTX_SCHED_BLOCKING_SYNC`), so a host waiting for the GPU sleeps instead of
spinning and the process's CPU time is the host's own work. Per shape, depth and arm: the step's
wall time (median of 5), its CPU time (process time, every thread: autograd runs backward on a
thread of its own), the GPU's busy time (sum of kernel times, torch.profiler), kernels per step, the profiler's
host ops by self CPU time, and a cProfile of one step sorted by own time (backward on the calling
thread for that step): what to cut to make the step GPU-bound. `--pass logprob` profiles the log-prob
pass instead (forward under `no_grad`, the model in eval mode, no graphs: the eager pass whose host
time bounds a scoring loop), and adds the cProfile sorted by cumulative time, which names the
stages (fla's, ours) a GDN layer's host time is spent in.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import functools
import importlib
import io
import pstats
import statistics
import time
from pathlib import Path

CU_CTX_SCHED_BLOCKING_SYNC = 4


def blocking_sync() -> None:
    """Before torch makes the primary context: waits for the GPU yield the CPU instead of spinning."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device = ctypes.c_int()
    status = cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0)
    status = status or cuda.cuDevicePrimaryCtxSetFlags_v2(device, CU_CTX_SCHED_BLOCKING_SYNC)
    if status:
        raise SystemExit(f"could not ask for blocking synchronisation (CUresult {status}): host CPU times would count spinning")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x2048x256")
    parser.add_argument("--layers", default="8,32")
    parser.add_argument(
        "--arms", default="packed,shared,aligned", help="packed, shared, aligned (shared, shared_prefix_chunk_aligned)"
    )
    parser.add_argument("--pass", dest="which", choices=("train", "logprob"), default="train")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)

    blocking_sync()
    import torch
    from shared_prefix_gpu import (
        MODULE,
        WIDTHS,
        checkpointed,
        config_for,
        logprob_pass,
        parse_shapes,
        shape_batch,
        train_step,
    )
    from torch.profiler import ProfilerActivity, profile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = io.StringIO()

    def say(text=""):
        print(text, flush=True)
        report.write(text + "\n")

    for layers in (int(x) for x in args.layers.split(",")):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = importlib.import_module(MODULE).Qwen3_5ForCausalLM(config_for(WIDTHS, layers)).bfloat16()
        checkpointed(model)
        model.train(args.which == "train")
        run = train_step if args.which == "train" else logprob_pass
        for shape in parse_shapes(args.shapes):
            ids, cu, max_len, _ = shape_batch(shape, WIDTHS["vocab_size"], "cuda")
            for arm in args.arms.split(","):
                model.config.shared_prefix_training = arm in ("shared", "aligned")
                model.config.shared_prefix_chunk_aligned = arm == "aligned"
                step = functools.partial(run, model, ids, cu, max_len)
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
                walls, cpus = [], []
                for _ in range(5):
                    torch.cuda.synchronize()
                    w0, c0 = time.perf_counter(), time.process_time()
                    step()
                    torch.cuda.synchronize()
                    walls.append((time.perf_counter() - w0) * 1e3)
                    cpus.append((time.process_time() - c0) * 1e3)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                events = prof.key_averages()
                kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
                busy = sum(e.self_device_time_total for e in kernels) / 1e3
                launches = sum(e.count for e in kernels)
                say(
                    f"=== {args.which} {shape[0]} layers={layers} {arm}: wall {statistics.median(walls):.1f} ms, "
                    f"host CPU {statistics.median(cpus):.1f} ms, GPU busy {busy:.1f} ms, {launches} kernels"
                )
                say(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70))
                profiler = cProfile.Profile()
                # cProfile sees one thread: run backward on this one for the profiled step
                with torch.autograd.set_multithreading_enabled(False):
                    profiler.enable()
                    step()
                    torch.cuda.synchronize()
                    profiler.disable()
                text = io.StringIO()
                stats = pstats.Stats(profiler, stream=text)
                stats.sort_stats("tottime").print_stats(args.top)
                if args.which == "logprob":
                    stats.sort_stats("cumulative").print_stats(2 * args.top)
                limit = 6000 if args.which == "train" else 16000
                say("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:limit])
        del model
        torch.cuda.empty_cache()
    (out / f"host_profile{'' if args.which == 'train' else '_logprob'}.txt").write_text(report.getvalue())


if __name__ == "__main__":
    main()
