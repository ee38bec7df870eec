"""`bench/shared_prefix_gpu.py --graphs --vary N`: the shared step under RL-like variation, eager and graphed.

Every step of RL brings new prompts and new response lengths, so a graph keyed on the exact layout would
capture at every step. Per shape, N micro-batches around the shape: every prompt length drawn in
P (1 +- `--vary-prompt`), every response length in R (1 +- `--vary-response`), the same N for both arms.
Both arms run the model's own training step without checkpointing over the same N
micro-batches (eager first: turning the graphs off drops the held ones), every step timed (with a device sync around it, captures included):

- `vary_eager`: `shared_prefix_cuda_graphs` off;
- `vary_graphs`: on, with buckets (the plan padded to a bucket, or to a held graph's: `bucket.py`);
- `vary_auto`: on, with `shared_prefix_cuda_graphs_training="auto"` (per step a replay or an eager step on the
  unpadded plan, whichever this model measured faster: `graphs/choice.py`), from fresh graphs.

Row keys: `vary_steps`, `vary_eager_ms` / `vary_graphs_ms` (mean step over all N), `vary_graphs_replay_ms`
(median over the steps that replayed), `vary_graphs_capture_ms` (median over the steps that captured),
`vary_captures`, `vary_replays`, `vary_evictions`, `vary_padding` (mean C* / C), `vary_auto_ms` (mean step),
`vary_auto_captures` / `_replays` / `_eager` (what its steps did), `vary_loss_rel_diff`
(largest |graphed - eager| / |eager| loss over the N: the padded step against the unpadded one, bf16
rounding of GEMMs over more rows; exact in float64, tests/models/test_layer_graph_buckets.py).
"""

from __future__ import annotations

import statistics
import time

import torch
from shared_prefix_arms import checkpointed, train_step
from shared_prefix_graphs import uncheckpointed


def varied_batches(shape, steps: int, vocab: int, device, prompt_spread: float, response_spread: float, seed=0):
    """`steps` packed rows of the shape's groups with drawn prompt and response lengths (ids, cu, max_len)."""
    _, groups, singles, system = shape
    gen = torch.Generator().manual_seed(seed)

    def draw(length, spread):
        lo, hi = max(1, round(length * (1 - spread))), max(1, round(length * (1 + spread)))
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    out = []
    for _ in range(steps):
        common = torch.randint(0, vocab, (system,), generator=gen)
        seqs = []
        for n, p, r in groups:
            own = max(1, draw(p, prompt_spread) - system)
            prompt = torch.cat([common, torch.randint(0, vocab, (own,), generator=gen)])
            seqs += [torch.cat([prompt, torch.randint(0, vocab, (draw(r, response_spread),), generator=gen)])
                     for _ in range(n)]
        seqs += [torch.randint(0, vocab, (s,), generator=gen) for s in singles]
        lengths = [len(s) for s in seqs]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        out.append((torch.cat(seqs).unsqueeze(0).to(device), cu.to(device), max(lengths)))
    return out


def _timed(model, batch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    loss = train_step(model, *batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - began) * 1e3, loss


def vary_arms(model, shape, row, args, device, vocab) -> None:
    """Run the two arms over `args.vary` varied micro-batches of `shape` into `row` (keys: module docstring)."""
    from patchgen.kernels.modeling.layer_graphs import graphs_of, use_graphs
    from patchgen.kernels.modeling.shared_prefix import observe_plans

    if getattr(shape, "turns", ()):
        row["vary_error"] = "multi-turn shapes are not varied"
        return
    batches = varied_batches(shape, args.vary, vocab, device, args.vary_prompt, args.vary_response)
    uncheckpointed(model)
    sharing = model.config.shared_prefix_training
    model.config.shared_prefix_training = True
    graphs_ms, kinds, rel, padding = [], [], [], []
    try:
        model.config.shared_prefix_cuda_graphs = False
        eager = [_timed(model, batch, device) for batch in batches]
        eager_ms = [ms for ms, _ in eager]
        model.config.shared_prefix_cuda_graphs = True
        plans = []
        for batch, (_, eager_loss) in zip(batches, eager):
            graphs = graphs_of(model)
            before = 0 if graphs is None else graphs.stats.captures
            plans.clear()
            with observe_plans(lambda plan, _tokens: plans.append(plan)):
                ms, graphed_loss = _timed(model, batch, device)
            graphs_ms.append(ms)
            kinds.append("capture" if graphs_of(model).stats.captures > before else "replay")
            rel.append(abs(graphed_loss.item() - eager_loss.item()) / max(abs(eager_loss.item()), 1e-30))
            plan = plans[-1] if plans else None
            if plan is not None and plan.bucket is not None:
                padding.append(plan.compact_length / plan.layout.compact_length)
        stats = graphs_of(model).stats
        use_graphs(model.model, None)  # the auto arm learns from fresh graphs
        model.config.shared_prefix_cuda_graphs_training = "auto"
        auto = [_timed(model, batch, device) for batch in batches]
        rel += [abs(loss.item() - e.item()) / max(abs(e.item()), 1e-30) for (_, loss), (_, e) in zip(auto, eager)]
        auto_stats = graphs_of(model).stats
        row.update(
            vary_auto_ms=statistics.mean(ms for ms, _ in auto),
            vary_auto_captures=auto_stats.captures,
            vary_auto_replays=auto_stats.replays,
            vary_auto_eager=auto_stats.eager,
            vary_auto_choice=graphs_of(model).choice.describe(),
        )
        row.update(
            vary_steps=len(batches),
            vary_eager_ms=statistics.mean(eager_ms),
            vary_graphs_ms=statistics.mean(graphs_ms),
            vary_graphs_replay_ms=_median([m for m, k in zip(graphs_ms, kinds) if k == "replay"]),
            vary_graphs_capture_ms=_median([m for m, k in zip(graphs_ms, kinds) if k == "capture"]),
            vary_captures=stats.captures,
            vary_replays=stats.replays,
            vary_evictions=stats.evictions,
            vary_padding=statistics.mean(padding) if padding else float("nan"),
            vary_loss_rel_diff=max(rel),
        )
    finally:
        model.config.shared_prefix_training = sharing
        model.config.shared_prefix_cuda_graphs = False
        model.config.shared_prefix_cuda_graphs_training = "graphs"
        use_graphs(model.model, None)
        checkpointed(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _median(values):
    return statistics.median(values) if values else float("nan")


def summary(row) -> str:
    if "vary_error" in row:
        return f"[{row['layers']}L] {row['shape']} varied: {row['vary_error']}"
    return (
        f"[{row['layers']}L] {row['shape']} varied x{row['vary_steps']}: eager {row['vary_eager_ms']:.0f} ms/step | "
        f"graphs {row['vary_graphs_ms']:.0f} ms/step ({row['vary_captures']} captures, median "
        f"{row['vary_graphs_capture_ms']:.0f} ms; {row['vary_replays']} replays, median "
        f"{row['vary_graphs_replay_ms']:.0f} ms; {row['vary_evictions']} evictions), C*/C {row['vary_padding']:.3f} | "
        f"auto {row['vary_auto_ms']:.0f} ms/step ({row['vary_auto_captures']} captures, {row['vary_auto_replays']} "
        f"replays, {row['vary_auto_eager']} eager), loss rel diff <= {row['vary_loss_rel_diff']:.2e}\n"
        f"    {row['vary_auto_choice']}"
    )
