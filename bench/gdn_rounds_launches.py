"""GDN launches per layer on our Triton backend, per-round stages vs joint rounds, for plans of 2 and 3 rounds.

    python bench/gdn_rounds_launches.py [--prompt 128] [--turn 64] [--response 16] [--out FILE]
    python bench/gdn_rounds_launches.py --backend fla --device cuda   # on a GPU (fla's kernels do not interpret)

One shared-prefix GDN layer (`shared_prefix_gated_delta_rule`, l2norm in kernel), tiny widths,
float32; on the CPU our Triton kernels run under TRITON_INTERPRET=1. Every Triton launch is counted
(one launch on the GPU too; on a GPU after a warm-up call, so autotuning is not counted), and the
aten ops of the layer's glue (gathers, casts, cats, the state hand-over) as `host_ops.count_events`
counts them. Plans: a group of 4 rollouts of one
prompt (plan depth 1, 2 rounds: the prompt, then the rollouts from its state) and trees branching
after one turn (depth 2, 3 rounds) and after two (depth 3, 4 rounds). Arms: `Rounds` (every stage once per round, the path before the joint
rounds) and `JointRounds` (state-free stages once for all rounds).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from pathlib import Path

if "cuda" not in sys.argv:  # before triton is imported: the CPU interpreter unless asked for a GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_ops import SLOT_PREFIX, count_events

TRITON_SCOPE = "triton:"  # a Triton launch is recorded as a slot scope, so the glue count skips its inside


@contextlib.contextmanager
def triton_launch_scopes():
    """Record every Triton kernel launch as a profiler scope `slot::triton:<kernel>` (interpreter or compiled)."""
    from triton.runtime import interpreter, jit

    patched = []
    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        run = cls.run

        def scoped(self, *args, _run=run, **kwargs):
            name = getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "kernel")
            with torch.profiler.record_function(SLOT_PREFIX + TRITON_SCOPE + name):
                return _run(self, *args, **kwargs)

        cls.run = scoped
        patched.append((cls, run))
    try:
        yield
    finally:
        for cls, run in patched:
            cls.run = run


def plans(prompt: int, turn: int, response: int, device="cpu"):
    """{rounds: plan}: 4 rollouts of one prompt (plan depth 1, 2 rounds), a tree branching after a turn
    (depth 2, 3 rounds) and after two turns (depth 3, 4 rounds)."""
    from patchgen.kernels.shared_prefix import build_plan

    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, 1000, (n,), generator=gen).tolist()

    base = tokens(prompt)
    group = [base + tokens(response) for _ in range(4)]
    tree = [base + mid + tokens(response) for mid in (tokens(turn), tokens(turn)) for _ in range(2)]
    turns = [base + a + b + tokens(response) for a in (tokens(turn), tokens(turn)) for b in (tokens(turn), tokens(turn))
             for _ in range(2)]
    out = {}
    for seqs in (group, tree, turns):
        ids = torch.tensor([t for s in seqs for t in s]).unsqueeze(0)
        cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
        plan = build_plan(ids.to(device), cu.to(device), max_depth=4, level_cost=0)
        out[len(plan.gdn.present)] = plan
    return out


def count_layer(plan, rounds, h=1, hv=2, k=16, v=16):
    """{"forward"/"backward": {"triton": launches, "glue": aten launches}} of one GDN layer."""
    from patchgen.kernels.shared_prefix import shared_prefix_gated_delta_rule

    def gdn(*args, **kwargs):
        raise AssertionError("the stages run, not the public function")

    gdn.rounds = rounds
    gen = torch.Generator().manual_seed(1)
    c = plan.compact_length
    q, kk = (torch.randn(1, c, h, k, generator=gen) for _ in range(2))
    inputs = [q, kk, torch.randn(1, c, hv, v, generator=gen), F.logsigmoid(torch.randn(1, c, hv, generator=gen)),
              torch.rand(1, c, hv, generator=gen)]
    device = plan.compact_src.device
    inputs = [x.to(device).requires_grad_() for x in inputs]
    if device.type == "cuda":  # compile and autotune before counting
        o = shared_prefix_gated_delta_rule(plan, gdn, *inputs, use_qk_l2norm_in_kernel=True)
        torch.autograd.grad(o, inputs, torch.ones_like(o))
        torch.cuda.synchronize()
    out = {}
    with triton_launch_scopes():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            o = shared_prefix_gated_delta_rule(plan, gdn, *inputs, use_qk_l2norm_in_kernel=True)
        out["forward"] = count_events(prof.events())
        weight = torch.ones_like(o)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(o, inputs, weight)
        out["backward"] = count_events(prof.events())
    return {
        phase: {"triton": sum(counts.slot_calls.values()), "glue": sum(counts.launches.values()),
                "kernels": sum(counts.by_slot.values(), start=collections.Counter())}
        for phase, counts in out.items()
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--turn", type=int, default=64)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--rounds", type=int, nargs="+", default=[2, 3, 4], choices=[2, 3, 4],
                        help="plans to count, by their rounds (plan depth + 1)")
    parser.add_argument("--backend", choices=["triton", "fla"], default="triton")
    parser.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.backend == "fla":
        from patchgen.kernels.backends.fla import _JointRounds as JointRounds
        from patchgen.kernels.backends.fla import _Rounds as Rounds
    else:
        from patchgen.kernels.triton.gated_delta_rule.rounds import JointRounds, Rounds

    arms = {"per-round": Rounds(), "joint": JointRounds()}
    results = {n: {arm: count_layer(plan, rounds) for arm, rounds in arms.items()}
               for n, plan in plans(args.prompt, args.turn, args.response, args.device).items() if n in args.rounds}
    mode = "interpreter" if args.device == "cpu" else args.device
    lines = [(f"GDN launches per layer, {args.backend} ({mode}, float32, tiny widths), torch {torch.__version__};"
              " triton = kernel launches, glue = aten ops that launch on CUDA"),
             f"{'depth':>5} {'rounds':>6} {'phase':>9} {'arm':>10} {'triton':>7} {'glue':>5} {'total':>6}"]
    for n, by_arm in results.items():
        for phase in ("forward", "backward"):
            for arm, counts in by_arm.items():
                c = counts[phase]
                lines.append(f"{n - 1:>5} {n:>6} {phase:>9} {arm:>10} {c['triton']:>7} {c['glue']:>5} {c['triton'] + c['glue']:>6}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
