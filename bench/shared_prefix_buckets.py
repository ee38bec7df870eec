"""Buckets of padded shared-prefix plans under RL-like variation: how often a graph would replay, and the
padding each mixer computes. Host only (plan building; no model, no device).

    python bench/shared_prefix_buckets.py [--steps 100] [--cache 1 2 4] [--shapes ...]

Per shape, `--steps` micro-batches drawn as `bench/shared_prefix_gpu.py --graphs --vary` draws them: every
prompt length in P (1 +- `--vary-prompt`), every response in R (1 +- `--vary-response`), a system prompt
kept whole, an agentic tree's turns drawn like prompts (`shared_prefix_vary.py` does not vary those; here
they are). Default shapes: the GPU bench's `4x2048x256`, `8x4096x256`, `4x1024x256`, `system-tree`,
`agentic`; `--shapes` also takes the older RL-draw shapes of `RL_SHAPES`. Reported, per cache size (an LRU
cache of graphs; a step pads to a held bucket when it fits, `choose_bucket`, else to its own and captures):

- capture share (the exact-layout key captures at every step);
- per mixer, padded over real (mean, and max over the steps): compact rows `C*/C`; GDN rows and chunks
  per round (`gdn0`, `gdn1`, ...); conv rows (`C*` + the rows its padding segments gather, over `C`);
  attention keys and (query, key) pairs; LM rows (never padded: a check);
- `work`: the padded step's weighted work over the unpadded step's, with the per-unit costs of `COST`
  (measured on the H200, see there); `step`: `work` plus the capture share times `CAPTURE_STEPS`, the
  expected cost of a step relative to an unpadded graphed one, captures included.

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
from patchgen.kernels.shared_prefix import bucket, build_plan
from shared_prefix_shapes import parse_shapes, tree_settings

# Cost of one unit of each mixer's work, in compact rows (one compact row = the projections, norms and
# MLP of every layer for one row, fwd + bwd: the GEMMs). From the H200 profile of the eager shared step
# (docs/bench/profile_NVIDIA_H200.txt, n=8 P=4096 R=256, 8 layers, 4B widths): aten::mm 82.8 ms over
# C = 6144 rows; fla's GDN forward + backward 13.8 ms over 6144 GDN rows = 96 chunks of 64 (its kernels
# run a block per chunk, full or not, so a chunk is the unit: 13.8 / 96 / (82.8 / 6144) = 10.7); flash
# attention fwd + bwd about 9 ms over 17.1M causal (query, key) pairs (4.0e-5); the LM head (addmm) 29.4
# ms over about 6150 LM rows (0.36). The conv from docs/bench/triton_profile_NVIDIA_H200_triton371.txt:
# 0.67 ms per layer fwd + bwd over about 16k rows of 8192 channels against 1.7 us of GEMMs per row and
# layer, on 6 of 8 layers (0.018).
# (bucket.py weighs buckets with the same GDN chunk and conv row costs, GDN_CHUNK_COST and CONV_ROW_COST;
# kept as numbers here so that this script also measures older bucket.py versions.)
COST = {"compact": 1.0, "gdn_chunk": 10.7, "conv_row": 0.018, "attention_pair": 4.0e-5, "lm_row": 0.36}
# a capture (two warm-ups and the captures) over a replay, in replayed steps: 417 ms against 80 ms at
# n=4 P=2048 R=256, 8 layers (docs/cuda_graphs.md, "varying lengths")
CAPTURE_STEPS = (417 - 80) / 80

DEFAULT_SHAPES = ["4x2048x256", "8x4096x256", "4x1024x256", "system-tree", "agentic"]
# name: (prompts G, rollouts n, prompt range, response range): the older RL draws (uniform ranges)
RL_SHAPES = {
    "g1n8-P2k-R256": (1, 8, (1800, 2300), (64, 512)),
    "g1n8-P2k-R1k": (1, 8, (1800, 2300), (256, 1800)),
    "g2n8-P1k-R512": (2, 8, (700, 1300), (128, 1024)),
    "g4n4-P512-R512": (4, 4, (300, 700), (64, 1024)),
    "g1n16-P4k-R2k": (1, 16, (3500, 4500), (512, 3500)),
}


def _pack(seqs):
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, cu


def _tokens(rng, count):
    return [rng.randrange(1, 150_000) for _ in range(count)]


def rl_batch(prompts, n, prompt_len, response_len, rng):
    seqs = []
    for _ in range(prompts):
        prompt = _tokens(rng, rng.randint(*prompt_len))
        seqs += [prompt + _tokens(rng, rng.randint(*response_len)) for _ in range(n)]
    return _pack(seqs)


def vary_batch(shape, rng, prompt_spread, response_spread):
    """A micro-batch around a GPU-bench `Shape`, its lengths drawn as `shared_prefix_vary.varied_batches` does."""

    def draw(length, spread):
        return rng.randint(max(1, round(length * (1 - spread))), max(1, round(length * (1 + spread))))

    _, groups, singles, system = shape
    turns, fan = getattr(shape, "turns", ()), getattr(shape, "fan", 2)
    common = _tokens(rng, system)
    seqs = []
    for n, p, r in groups:
        level = [common + _tokens(rng, max(1, draw(p, prompt_spread) - system))]
        for length in turns:  # an agentic tree: every branch its own drawn turn
            level = [s + _tokens(rng, draw(length, prompt_spread)) for s in level for _ in range(fan)]
        count = fan if turns else n
        seqs += [s + _tokens(rng, draw(r, response_spread)) for s in level for _ in range(count)]
    seqs += [_tokens(rng, s) for s in singles]
    return _pack(seqs)


def _pairs(cu_q, cu_k) -> int:
    """Causal (query, key) pairs of a varlen call, bottom-right aligned."""
    q, k = np.diff(cu_q.numpy()).astype(np.int64), np.diff(cu_k.numpy()).astype(np.int64)
    return int((q * (k - q) + q * (q + 1) // 2).sum())


def counts(plan) -> dict:
    """The work a plan's layer stack does, per mixer (rows, chunks, pairs)."""
    out = {"C": plan.compact_length}
    for r, rnd in enumerate(plan.gdn.rounds):
        out[f"gdn{r}_rows"] = 0 if rnd is None else rnd.rows
        out[f"gdn{r}_chunks"] = 0 if rnd is None else rnd.chunk_indices.shape[0]
    extra = plan.conv.extra_src
    out["conv_rows"] = plan.compact_length + (0 if extra is None else len(extra))
    out["attention_keys"] = plan.attention.kv_src.numel()
    out["attention_pairs"] = _pairs(plan.attention.cu_seqlens_q, plan.attention.cu_seqlens_k)
    out["lm_rows"] = plan.lm.length
    chunks = sum(v for k, v in out.items() if k.endswith("_chunks"))
    out["work"] = (COST["compact"] * out["C"] + COST["gdn_chunk"] * chunks + COST["conv_row"] * out["conv_rows"]
                   + COST["attention_pair"] * out["attention_pairs"] + COST["lm_row"] * out["lm_rows"])
    return out


def replay_run(rows, size: int, settings: dict, regret: bool = False, skip: int = 0):
    """Capture share of an LRU graph cache of `size` entries over the micro-batches `rows`, each padded as a
    graphed step pads it: to a held graph's bucket when it fits (`choose_bucket`), else to its own; with `regret`,
    by rent or buy among the held buckets (`bucket.PaddingRegret`). The first `skip` steps warm the cache and
    are left out of both the share and the plans returned."""
    cache, captures, chosen = OrderedDict(), 0, []
    policy = bucket.PaddingRegret(capture_steps=CAPTURE_STEPS) if regret else None
    for ids, cu in rows:
        padded = build_plan(ids, cu, conv_kernel_size=4, pad_to_bucket=True, held_buckets=tuple(reversed(cache)),
                            padding_regret=policy, **settings)
        key = padded.bucket
        chosen.append(padded)
        if key in cache:
            cache.move_to_end(key)
            continue
        captures += len(chosen) > skip
        cache[key] = True
        while len(cache) > size:
            cache.popitem(last=False)
    return captures / max(len(rows) - skip, 1), chosen[skip:]


def timed_plans(rows, **kwargs):
    """The plans of `rows` and the median wall-clock ms of building one."""
    plans, times = [], []
    for ids, cu in rows:
        began = time.perf_counter()
        plans.append(build_plan(ids, cu, conv_kernel_size=4, **kwargs))
        times.append((time.perf_counter() - began) * 1e3)
    return plans, statistics.median(times)


def ratios(plain, padded) -> dict:
    real, pad = counts(plain), counts(padded)
    return {k: pad[k] / real[k] for k in real if real[k]} | {k: float("inf") for k in real if not real[k] and pad[k]}


def _shape_rows(name, steps, args, rng):
    if name in RL_SHAPES:
        return [rl_batch(*RL_SHAPES[name], rng) for _ in range(steps)], {}
    (shape,) = parse_shapes(name)
    if args.draw == "loop":  # the very micro-batches of `scoring_loop.py --vary --batches STEPS` (same draw, same seed)
        from shared_prefix_vary import varied_batches

        drawn = varied_batches(shape, steps, 151936, "cpu", args.vary_prompt, args.vary_response, seed=args.seed)
        rows = [(ids, cu) for ids, cu, _ in drawn]
    else:
        rows = [vary_batch(shape, rng, args.vary_prompt, args.vary_response) for _ in range(steps)]
    return rows, tree_settings(shape) | {"level_cost": getattr(shape, "level_cost", None) or 0}


def measure(name, args):
    rng = random.Random(args.seed)
    rows, settings = _shape_rows(name, args.steps, args, rng)
    plain, plain_ms = timed_plans(rows, **settings)
    own, own_ms = timed_plans(rows, pad_to_bucket=True, **settings)
    real = counts(plain[0])
    print(f"{name}: {args.steps} steps of ~{rows[0][0].shape[1]} tokens (first: C={real['C']}, "
          f"{sum(1 for k in real if k.endswith('_chunks'))} GDN rounds), {len({p.bucket for p in own})} distinct "
          f"own buckets (exact layouts: {args.steps}); plan build median {plain_ms:.2f} ms, padded {own_ms:.2f} ms",
          flush=True)
    for size in args.cache:
        # --cycles: the steps again and again, as a scoring loop's warm and timed loops score the same micro-batches;
        # reported over the cycles after the first
        skip = len(rows) if args.cycles > 1 else 0
        share, chosen = replay_run(rows * args.cycles, size, settings, regret=args.policy == "regret", skip=skip)
        found = [ratios(a, b) for a, b in zip(plain * args.cycles, chosen)]
        keys = [k for k in found[0] if all(k in f for f in found)]
        mean = {k: float(np.mean([f[k] for f in found])) for k in keys}
        top = {k: max(f[k] for f in found) for k in keys}
        print(f"    cache {size}: capture share {share:.2f}; work x{mean['work']:.3f} (max {top['work']:.3f}); "
              f"step x{mean['work'] + share * CAPTURE_STEPS:.3f} (captures at {CAPTURE_STEPS:.1f} steps each)")
        print("        " + ", ".join(f"{k} x{mean[k]:.3f} ({top[k]:.3f})" for k in keys if k != "work"), flush=True)


LADDER_HELP = ("A/B: the compact row's bucket ladder ratio for this run (bucket.COMPACT_RATIO, default "
               f"{'/'.join(map(str, bucket.COMPACT_RATIO))}): a finer ladder pads fewer rows and may capture more buckets")
REUSE_HELP = (f"A/B: how much more a held graph's bucket may cost than a layout's own for the layout to pad to it (or to "
              f"a merge) rather than capture its own (bucket.REUSE, default {bucket.REUSE}): lower pads less and captures more")


def add_bucket_knobs(parser) -> None:
    """The bucket A/B options a script takes: `--compact-ladder UP/DOWN`, `--reuse R`."""
    parser.add_argument("--compact-ladder", default=None, metavar="UP/DOWN", help=LADDER_HELP)
    parser.add_argument("--reuse", type=float, default=None, metavar="R", help=REUSE_HELP)


def apply_bucket_knobs(args) -> None:
    """Set the bucket knobs given on the command line for the rest of the process (a script's A/B)."""
    if args.compact_ladder:
        up, _, down = args.compact_ladder.partition("/")
        if not (up.isdigit() and down.isdigit() and int(up) > int(down) > 0):
            raise SystemExit(f"--compact-ladder: {args.compact_ladder!r} is not UP/DOWN with UP > DOWN > 0 (say 33/32)")
        bucket.COMPACT_RATIO = (int(up), int(down))
        print(f"the compact row's bucket ladder for this run: {up}/{down}", flush=True)
    if args.reuse is not None:
        if not args.reuse >= 1:
            raise SystemExit(f"--reuse: {args.reuse} is below 1 (a held bucket costs at least a layout's own; say 1.1)")
        bucket.REUSE = args.reuse
        print(f"the reuse bound of held buckets for this run: {args.reuse}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cache", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES,
                        help=f"GPU-bench shape names (n x P x R, system-tree, agentic, ...) or {', '.join(RL_SHAPES)}")
    parser.add_argument("--vary-prompt", type=float, default=0.1, help="prompt (and turn) lengths in P (1 +- this)")
    parser.add_argument("--vary-response", type=float, default=0.5, help="response lengths in R (1 +- this)")
    parser.add_argument("--seed", type=int, default=0)
    add_bucket_knobs(parser)
    parser.add_argument("--draw", choices=("buckets", "loop"), default="buckets",
                        help="how the steps are drawn: this script's own draw, or scoring_loop.py --vary's micro-batches")
    parser.add_argument("--cycles", type=int, default=1,
                        help="score the steps this many times over (as a scoring loop does), reporting the later cycles")
    parser.add_argument("--policy", choices=("bound", "regret"), default="bound",
                        help="how a layout picks among held buckets: the fixed reuse bound (bucket.choose_bucket, the "
                             "product's) or rent or buy (bucket.PaddingRegret: a held bucket whose padding has cost a "
                             "capture gives way to the merge of the layouts' own buckets)")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        raise SystemExit(f"--cycles: {args.cycles} is below 1 (the steps are scored at least once)")
    if args.draw == "loop" and any(name in RL_SHAPES for name in args.shapes):
        raise SystemExit(f"--draw loop draws around GPU-bench shapes (n x P x R, trees); {', '.join(RL_SHAPES)} have their own draw")
    apply_bucket_knobs(args)
    for name in args.shapes:
        measure(name, args)


if __name__ == "__main__":
    main()
