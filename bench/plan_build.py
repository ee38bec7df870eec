"""Shared-prefix plan building on the host: time per micro-batch and the T/C each batch reaches.

    python bench/plan_build.py [--repeats 30] [--depth 4]
    python bench/plan_build.py --pad [--shapes 4x2048x256,8x4096x256,system-tree,agentic,agentic-4]

Prints the median and the largest plan-building time (wall clock) and the median CPU time of the
building thread, for RL-like micro-batches of about 16k and 64k tokens: GRPO groups with short
and long prompts, many short rollouts, a system prompt over all groups, 3-turn agentic trees
(positions None; M-RoPE rows [3, 1, T] per sequence, offset, and not counting; `--device cuda` puts the inputs on the GPU, so the
timing includes the one device-to-host and the index upload), with one level (`max_depth=1`) and
as a prefix tree (`max_depth=--depth`, the config default); then T, C and T/C for GRPO-like
batches, the system-prompt control and a 3-turn agentic shape, one level against the tree (T / C
is the bound of section 5 of shared_prefix.md: the token-wise work shrinks by that factor). On a
host shared with other jobs the wall clock includes waiting for a core; the CPU time does not.
`--pad`: instead, the GPU bench's shapes (`shared_prefix_shapes.py`, per-sequence positions on the host, their
tree settings) built plain and padded to bucket counts (`pad_to_bucket=True`, a CUDA-graphed step's plan),
alternating call by call, and the padded build's CPU time over the plain one's.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch
from patchgen.kernels.shared_prefix import DEFAULT_MAX_DEPTH, build_plan, resolve_level_cost


def grpo_batch(prompts, n, prompt_len, response_len, system_len=0, seed=0):
    """`prompts` prompts x `n` rollouts, optional shared system prompt; lengths are (lo, hi) ranges."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 150_000) for _ in range(system_len)]
    seqs = []
    for _ in range(prompts):
        prompt = system + [rng.randrange(1, 150_000) for _ in range(rng.randint(*prompt_len))]
        for _ in range(n):
            seqs.append(prompt + [rng.randrange(1, 150_000) for _ in range(rng.randint(*response_len))])
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, cu


def agentic_batch(prompt_len, turns, last, fan=2, rollouts_of=1, seed=0):
    """Multi-turn rollouts that branch `fan` ways at every turn: `turns` shared turn lengths, then `last` own tokens."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(1, 150_000) for _ in range(n)]

    seqs = []
    for _ in range(rollouts_of):
        level = [toks(prompt_len)]
        for length in (*turns, last):
            level = [s + toks(length) for s in level for _ in range(fan)]
        seqs += level
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, cu


def mrope(cu, length):
    pos = torch.cat([torch.arange(int(b - a)) for a, b in itertools.pairwise(cu)])
    return pos.expand(3, length).reshape(3, 1, length).contiguous()


def timings_ms(fn, repeats, sync=lambda: None):
    """(median wall, largest wall, median CPU of this thread) in ms, after one warm-up call."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        sync()
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        sync()
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return 1e3 * statistics.median(wall), 1e3 * max(wall), 1e3 * statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu", help="where input_ids live (cuda: includes the copies)")
    parser.add_argument("--depth", type=int, default=DEFAULT_MAX_DEPTH, help="max_depth of the tree plans")
    parser.add_argument("--pad", action="store_true", help="plain against padded plans at the GPU bench's shapes")
    parser.add_argument("--shapes", default="4x2048x256,8x4096x256,system-tree,agentic,agentic-4",
                        help="with --pad: shapes of shared_prefix_shapes.py, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.pad:
        padded_against_plain(args.shapes, args.repeats)
        return

    print(f"plan building (host: one thread; inputs on {args.device}; median of {args.repeats})")
    print(
        "[3,1,T]: per-sequence M-RoPE rows; [3,1,T]*: one row counts from 1 (rows that do not restart per"
        " sequence); [3,1,T]~: one row also steps by 2 at every 4th offset (rows that do not count up,"
        " compared row by row)"
    )
    print(f"depth: max_depth of the plan (1: one level; {args.depth}: the tree); levels: the depth it chose")
    cost = resolve_level_cost(args.device)
    print(f"level cost of the trees: {cost.rows} rows ({cost.source})")
    print("ms: median wall clock; max ms: the largest; cpu ms: median CPU time of the building thread")
    print(
        f"{'batch':<44} {'T':>7} {'seqs':>5} {'depth':>5} {'levels':>6} {'positions':>10}"
        f" {'ms':>7} {'max ms':>7} {'cpu ms':>7}"
    )
    timing = {
        "16k: 2 prompts x 8, P~500, R~500": grpo_batch(2, 8, (400, 600), (256, 768), seed=1),
        "64k: 8 prompts x 8, P~500, R~500": grpo_batch(8, 8, (400, 600), (256, 768), seed=2),
        "64k: 1 prompt x 8, P=7680, R=512": grpo_batch(1, 8, (7680, 7680), (512, 512), seed=12),
        "70k: 1 prompt x 8, P=8192, R=512": grpo_batch(1, 8, (8192, 8192), (512, 512), seed=13),
        "64k: 64 prompts x 4, P~200, R~50": grpo_batch(64, 4, (150, 250), (10, 90), seed=3),
        "64k: 128 prompts x 4, P=96, R=32 (512 seqs)": grpo_batch(128, 4, (96, 96), (32, 32), seed=14),
        "64k: 128 system + 64 prompts x 4, P=R=64": grpo_batch(64, 4, (64, 64), (64, 64), system_len=128, seed=15),
        "70k: 512 system + 8 prompts x 8, P~200": grpo_batch(8, 8, (150, 250), (256, 512), system_len=512, seed=7),
        "64k: 8 agentic trees, 3 turns x 2": agentic_batch(512, (128, 128), 256, rollouts_of=8, seed=8),
    }
    for name, (ids, cu) in timing.items():
        t = ids.shape[1]
        ids, cu = ids.to(args.device), cu.to(args.device)
        shifted = mrope(cu.cpu(), t).to(args.device)
        shifted[1] += 1  # rows that do not restart per sequence: grouped by their per-sequence constants
        stepped = shifted.clone()
        stepped[2] += (shifted[0] % 4 == 0).long()  # rows that do not count up: packed and compared row by row
        for depth in sorted({1, args.depth}):
            for label, pos in (
                ("None", None),
                ("[3,1,T]", mrope(cu.cpu(), t).to(args.device)),
                ("[3,1,T]*", shifted),
                ("[3,1,T]~", stepped),
            ):
                plan = build_plan(ids, cu, pos, max_depth=depth)
                sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
                ms, slowest, cpu = timings_ms(
                    lambda ids=ids, cu=cu, pos=pos, depth=depth: build_plan(ids, cu, pos, max_depth=depth),
                    args.repeats,
                    sync,
                )
                print(
                    f"{name:<44} {t:>7} {len(cu) - 1:>5} {depth:>5} {plan.depth:>6} {label:>10}"
                    f" {ms:>7.2f} {slowest:>7.2f} {cpu:>7.2f}"
                )

    print()
    print(f"T / C for GRPO-like and multi-turn batches: one level (max_depth=1) and tree (max_depth={args.depth})")
    print(f"{'batch':<52} {'T':>7} {'C one':>7} {'T/C':>6} {'C tree':>7} {'T/C':>6} {'levels':>6} {'L tree':>7}")
    batches = {
        "n=4, P=2048, R=256 (section 5 example)": grpo_batch(2, 4, (2048, 2048), (256, 256), seed=4),
        "n=8, P~1k, R~0.5k (uniform 256..768)": grpo_batch(3, 8, (900, 1100), (256, 768), seed=5),
        "n=16, 64-token system + P~300, R~1..600": grpo_batch(4, 16, (250, 350), (1, 600), system_len=64, seed=6),
        "system-prompt control: 2x4, 1024 + 512, R=256": grpo_batch(
            2, 4, (512, 512), (256, 256), system_len=1024, seed=9
        ),
        "3-turn agentic: P=1024, 256/turn, x2 per turn (8)": agentic_batch(1024, (256, 256), 256, seed=10),
        "3-turn agentic, 4 prompts (32 rollouts)": agentic_batch(1024, (256, 256), 256, rollouts_of=4, seed=11),
    }
    for name, (ids, cu) in batches.items():
        one, tree = build_plan(ids, cu), build_plan(ids, cu, max_depth=args.depth)
        t, c1, c2 = one.packed_length, one.compact_length, tree.compact_length
        print(
            f"{name:<52} {t:>7} {c1:>7} {t / c1:>6.2f} {c2:>7} {t / c2:>6.2f} {tree.depth:>6} {tree.lm.length:>7}"
        )


def padded_against_plain(shapes: str, repeats: int) -> None:
    """Median CPU ms of the plain and the padded build of each shape, alternating call by call."""
    from patchgen.kernels.shared_prefix import positions_from_cu_seqlens
    from shared_prefix_shapes import parse_shapes, shape_batch, tree_settings

    print(f"plan building, plain and padded to bucket counts (host: one thread; median CPU ms of {repeats})")
    print(f"{'shape':<60} {'T':>6} {'C':>6} {'C*':>6} {'plain':>6} {'padded':>6} {'ratio':>6}")
    for shape in parse_shapes(shapes):
        ids, cu, _, _ = shape_batch(shape, 512, "cpu")
        pos = positions_from_cu_seqlens(cu, ids.shape[1])
        kwargs = {"conv_kernel_size": 4, "min_prefix": 64, **tree_settings(shape)}
        plans = {pad: build_plan(ids, cu, pos, pad_to_bucket=pad, **kwargs) for pad in (False, True)}
        cpu = {False: [], True: []}
        for _ in range(repeats):
            for pad, times in cpu.items():
                start = time.thread_time()
                build_plan(ids, cu, pos, pad_to_bucket=pad, **kwargs)
                times.append(1e3 * (time.thread_time() - start))
        plain, padded = statistics.median(cpu[False]), statistics.median(cpu[True])
        print(
            f"{shape.name:<60} {ids.shape[1]:>6} {plans[False].compact_length:>6} {plans[True].compact_length:>6}"
            f" {plain:>6.2f} {padded:>6.2f} {padded / plain:>6.2f}"
        )


if __name__ == "__main__":
    main()
