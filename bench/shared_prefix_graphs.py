"""The `--graphs` arms of `bench/shared_prefix_gpu.py`: the shared-prefix training step without activation
checkpointing, eager (`shared_eager`) and with `shared_prefix_cuda_graphs` (`shared_graphs`), and the
log-prob pass of each (under `no_grad`: the scoring graph in `shared_graphs`).

Both run the model's own step (`shared_prefix_arms.train_step`: forward with labels, backward), the
way a trainer calls it; the graphs capture on the arm's first warm-up call of a shape (outside the
timing) and replay in every timed call. Per shape: step ms, host vs GPU ms, peak memory (allocated;
a graph's private pool is reserved, and given as `shared_graphs_reserved_gib`), efficiency against
the bound T / C with packed (checkpointed, as the other arms) as the reference, the graphs' counters,
and whether the graphed step's loss and the graphed log-probs equal the eager ones bit for bit (with
buckets, the default, the graphed forwards run the padded plan: equal up to the bf16 rounding of GEMMs
over more rows; the loss's relative difference is `graphs_loss_rel_diff`).
"""

from __future__ import annotations

import functools
import math

import torch
from shared_prefix_arms import ARMS, checkpointed, logprob_pass, train_step
from shared_prefix_timing import Repeats, measure

GRAPH_ARMS = ("shared_eager", "shared_graphs")
for _arm in GRAPH_ARMS:
    ARMS.setdefault(_arm, (True, train_step, logprob_pass))


def uncheckpointed(model):
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    return model


def graph_arms(model, row, inputs, args, device, timer, cost_us, run_arm) -> dict:
    """Run the two arms into `row` (same keys as `run_arm`'s, arm names `shared_eager` / `shared_graphs`)."""
    from patchgen.kernels.modeling.layer_graphs import graphs_of, use_graphs

    outputs = {}
    uncheckpointed(model)
    try:
        for arm in GRAPH_ARMS:
            model.config.shared_prefix_cuda_graphs = arm == "shared_graphs"
            outputs[arm] = run_arm(model, arm, row, inputs, args, device, timer, cost_us)
            if arm == "shared_graphs":
                if row.get("shared_graphs_logprob_ms"):
                    _logprob_with_reuse(model, row, inputs, args, device, timer)
                graphs = graphs_of(model)
                if graphs is not None:
                    s = graphs.stats
                    row["graphs_captures"], row["graphs_replays"] = s.captures, s.replays
                if device.type == "cuda":
                    row["shared_graphs_reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    finally:
        model.config.shared_prefix_cuda_graphs = False
        use_graphs(model.model, None)  # this shape's graphs and pools go before the next shape
        checkpointed(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for kind, flag in (("train", "graphs_loss_bitequal"), ("logprob", "graphs_logprobs_bitequal")):
        a, b = outputs["shared_eager"].get(kind), outputs["shared_graphs"].get(kind)
        row[flag] = "" if a is None or b is None else bool(torch.equal(a, b))
    a, b = outputs["shared_eager"].get("train"), outputs["shared_graphs"].get("train")
    if a is not None and b is not None:
        row["graphs_loss_rel_diff"] = ((a.double() - b.double()).abs() / a.double().abs().clamp_min(1e-30)).max().item()
    get = functools.partial(row.get)
    for arm in GRAPH_ARMS:
        for kind in ("train", "logprob", "logprob_reuse"):
            packed, mine = get(f"packed_{kind.split('_')[0]}_ms"), get(f"{arm}_{kind}_ms")
            if packed and mine and not math.isnan(mine):
                row[f"speedup_{arm}_{kind}"] = packed / mine
                row[f"efficiency_{arm}_{kind}"] = packed / mine / row["bound"]
    return outputs


def _logprob_with_reuse(model, row, inputs, args, device, timer) -> None:
    """The graphed log-prob pass of a batch whose plan an earlier pass built (`shared_prefix_plan_reuse`): what
    an RL step's later passes over one micro-batch (old policy, training) take. Records the time and how many
    calls were handed the kept plan (`plan_reuse_hits`: every timed call, or the figure is not that case)."""
    from patchgen.kernels.shared_prefix.plan_reuse import PLANS

    model.config.shared_prefix_training = True  # `run_arm` turned it off at its end
    model.config.shared_prefix_plan_reuse = True
    try:
        logprob_pass(model, *inputs)  # builds and keeps the plan
        hits = PLANS.hits
        m = measure(model, logprob_pass, inputs, timer, Repeats(args.repeats, args.min_repeats, args.repeat_ms), device)
        row["shared_graphs_logprob_reuse_ms"] = m.median
        row["plan_reuse_hits"], row["plan_reuse_calls"] = PLANS.hits - hits, m.count
    finally:
        model.config.shared_prefix_plan_reuse = False
        model.config.shared_prefix_training = False


def summary(row) -> str:
    def f(key, fmt=".0f"):
        value = row.get(key)
        return "-" if value is None or math.isnan(value) else format(value, fmt)

    return (
        f"[{row['layers']}L] {row['shape']}: shared no-ckpt eager {f('shared_eager_train_ms')} ms (host/GPU "
        f"{f('shared_eager_host_ms')}/{f('shared_eager_gpu_ms')}, eff {f('efficiency_shared_eager_train', '.2f')}) | "
        f"graphs {f('shared_graphs_train_ms')} ms (host/GPU {f('shared_graphs_host_ms')}/{f('shared_graphs_gpu_ms')}, "
        f"eff {f('efficiency_shared_graphs_train', '.2f')}, peak {f('shared_graphs_train_peak_gib', '.1f')} GiB, "
        f"reserved {f('shared_graphs_reserved_gib', '.1f')} GiB, {row.get('graphs_captures', '-')} captures / "
        f"{row.get('graphs_replays', '-')} replays, loss bit-equal to eager {row.get('graphs_loss_bitequal', '-')}, "
        f"rel diff {f('graphs_loss_rel_diff', '.1e')}) | "
        f"log-probs: eager {f('shared_eager_logprob_ms')} ms, graphs {f('shared_graphs_logprob_ms')} ms (eff "
        f"{f('efficiency_shared_graphs_logprob', '.2f')}, bit-equal to eager {row.get('graphs_logprobs_bitequal', '-')}; "
        f"plan reused {f('shared_graphs_logprob_reuse_ms')} ms, eff {f('efficiency_shared_graphs_logprob_reuse', '.2f')}, "
        f"{row.get('plan_reuse_hits', '-')} of {row.get('plan_reuse_calls', '-')} calls reused)"
        + "".join(f"; {k}: {v}" for k, v in row.items() if k.startswith("shared_graphs") and k.endswith("_error"))
    )
