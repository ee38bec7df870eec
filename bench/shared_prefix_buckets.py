"""Buckets of padded shared-prefix plans under RL-like variation: how often a graph would replay, and the
padding each mixer computes. Host only (plan building; no model, no device).

    python bench/shared_prefix_buckets.py [--steps 200] [--cache 1 2 4 8] [--shapes ...]

Per shape (G prompts x n rollouts, prompt lengths uniform in [P_lo, P_hi], response lengths uniform in
[R_lo, R_hi], every step new lengths, as in RL), over `--steps` micro-batches: the distinct buckets,
the share of steps that would capture with an LRU cache of each `--cache` size (the exact-layout key:
every step), and the padding: compact rows C*/C, GDN rows (every round) over the real rounds' rows,
GDN chunks over real chunks, conv rows over C, attention keys over real keys (means and maxima); and
the median wall-clock time of building a plan, unpadded and padded (host, this process).
The key of a graphed step is the plan's bucket plus what the model fixes (dtype, weights), so the
capture share here is the share a `--graphs --vary` GPU run reports.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import OrderedDict

import numpy as np
import torch
from patchgen.kernels.shared_prefix import build_plan

# name: (prompts G, rollouts n, prompt range, response range)
SHAPES = {
    "g1n8-P2k-R256": (1, 8, (1800, 2300), (64, 512)),
    "g1n8-P2k-R1k": (1, 8, (1800, 2300), (256, 1800)),
    "g2n8-P1k-R512": (2, 8, (700, 1300), (128, 1024)),
    "g4n4-P512-R512": (4, 4, (300, 700), (64, 1024)),
    "g1n16-P4k-R2k": (1, 16, (3500, 4500), (512, 3500)),
}


def batch(prompts, n, prompt_len, response_len, rng):
    seqs = []
    for _ in range(prompts):
        prompt = [rng.randrange(1, 150_000) for _ in range(rng.randint(*prompt_len))]
        seqs += [prompt + [rng.randrange(1, 150_000) for _ in range(rng.randint(*response_len))] for _ in range(n)]
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, cu


def replay_run(rows, size: int):
    """Capture share of an LRU graph cache of `size` entries over the micro-batches `rows`, each padded as a
    graphed step pads it: to a held graph's bucket when it fits (`choose_bucket`), else to its own; and the
    padding (mean rows over the unpadded plan's) of the buckets chosen."""
    cache, captures, chosen = OrderedDict(), 0, []
    for ids, cu in rows:
        padded = build_plan(ids, cu, conv_kernel_size=4, pad_to_bucket=True, held_buckets=tuple(reversed(cache)))
        key = padded.bucket
        chosen.append(padded)
        if key in cache:
            cache.move_to_end(key)
            continue
        captures += 1
        cache[key] = True
        while len(cache) > size:
            cache.popitem(last=False)
    return captures / len(rows), chosen


def gdn_counts(plan):
    rows = sum(rnd.rows for rnd in plan.gdn.rounds if rnd is not None)
    chunks = sum(rnd.chunk_indices.shape[0] for rnd in plan.gdn.rounds if rnd is not None)
    return rows, chunks


def timed_plans(rows, **kwargs):
    """The plans of `rows` and the median wall-clock ms of building one."""
    plans, times = [], []
    for ids, cu in rows:
        began = time.perf_counter()
        plans.append(build_plan(ids, cu, conv_kernel_size=4, **kwargs))
        times.append((time.perf_counter() - began) * 1e3)
    return plans, statistics.median(times)


def padding(plain, padded) -> dict:
    (r0, c0), (r1, c1) = gdn_counts(plain), gdn_counts(padded)
    return {
        "C": padded.compact_length / plain.compact_length,
        "gdn_rows": r1 / r0,
        "gdn_chunks": c1 / c0,
        "conv_rows": (padded.compact_length + len(padded.conv.extra_src)) / plain.compact_length,
        "attention_keys": padded.attention.kv_src.numel() / plain.attention.kv_src.numel(),
    }


def measure(name, steps, caches, seed):
    prompts, n, prompt_len, response_len = SHAPES[name]
    rng = random.Random(seed)
    rows = [batch(prompts, n, prompt_len, response_len, rng) for _ in range(steps)]
    plain, plain_ms = timed_plans(rows)
    own, own_ms = timed_plans(rows, pad_to_bucket=True)
    print(f"{name}: {steps} steps of ~{rows[0][0].shape[1]} tokens, {len({p.bucket for p in own})} distinct own "
          f"buckets (exact layouts: {steps}); plan build median {plain_ms:.2f} ms, padded {own_ms:.2f} ms")
    for size in caches:
        share, chosen = replay_run(rows, size)
        ratios = [padding(a, b) for a, b in zip(plain, chosen)]
        waste = ", ".join(f"{k} x{np.mean([r[k] for r in ratios]):.3f} (max {max(r[k] for r in ratios):.3f})"
                          for k in ratios[0])
        print(f"    cache {size}: capture share {share:.2f}; padding {waste}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cache", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in args.shapes:
        measure(name, args.steps, args.cache, args.seed)


if __name__ == "__main__":
    main()
