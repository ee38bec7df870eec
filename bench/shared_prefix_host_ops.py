"""Host work of a training step on the CPU, packed vs shared prefix: launches per layer and per step.

    python bench/shared_prefix_host_ops.py [--shape 4x256x32] [--repeats 5] [--top 25] [--out FILE]
                                           [--conv-look-back gathered|rows|x]

The tiny Qwen3.5 of the generated GPU module (torch backends), float32, activation checkpointing
as on the GPU bench, every op slot opaque (`host_ops.py`). Per arm: launch-equivalent aten ops of
the modelling glue (everything outside the slots), forward and backward, per step, per GDN layer
and per attention layer (by difference between models of 2, 3 and 3 layers), slot calls, the
top glue ops of each layer kind, the host reads (possible syncs on a GPU) with their call sites,
and host ms per step (median wall, and the part outside the slots). The layer counts carry over to
the GPU, where each launch costs the host tens of microseconds (docs/bench/host_profile_*).
The GDN kernels inside the slot, per-round stages vs joint rounds: `bench/gdn_rounds_launches.py`.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_ops import HostReads, Timer, count_events, scope_slots
from shared_prefix_arms import MODULE, TINY, boundary_labels, packed_kwargs
from shared_prefix_shapes import batch

SLOTS = ("gated_delta_rule", "causal_conv1d", "rms_norm_gated", "rms_norm", "rotary", "swiglu_mlp", "attention",
         "cross_entropy")
LIN, FULL = "linear_attention", "full_attention"
MODELS = {"base": [LIN, FULL], "gdn": [LIN, LIN, FULL], "attn": [LIN, FULL, FULL]}


# How the shared conv gets its look-back (shared_prefix/conv.py), emulated by the torch reference:
# "gathered" rows around the call (a backend without state kernels), "rows" state gathered around the
# call (fla's protocol, the reference's own), "x": the kernels read it from x (our Triton conv's).
CONV_LOOK_BACK = ("gathered", "rows", "x")


def build(layer_types, checkpointing: bool, conv_look_back: str = "rows"):
    import importlib

    from patchgen.kernels.reference.gated_delta_rule import gated_delta_rule as ref_gdn
    from patchgen.kernels.shared_prefix.gdn_rounds import ReferenceRounds
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        num_hidden_layers=len(layer_types), layer_types=list(layer_types), tie_word_embeddings=False, use_cache=False,
        **TINY,
    )
    torch.manual_seed(0)
    model = importlib.import_module(MODULE).Qwen3_5ForCausalLM(config).float()
    if checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    scoped = scope_slots(model, SLOTS, gdn_rounds=ReferenceRounds(ref_gdn))
    conv = scoped.causal_conv1d
    if conv_look_back == "gathered":
        del conv.look_back
    elif conv_look_back == "x":
        from host_ops import _ScopedRounds
        from patchgen.kernels.reference.causal_conv1d import LookBackFromX

        conv.look_back = _ScopedRounds(LookBackFromX(), "causal_conv1d.")
    return model.train()


def step(model, ids, cu, max_len, labels):
    if labels is None:  # the log-prob pass: forward under no_grad, per-token log-probs, no loss
        with torch.no_grad():
            return model(input_ids=ids, return_log_probs=True, return_logits=False,
                         **packed_kwargs(cu, max_len)).log_probs
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, return_logits=False, **packed_kwargs(cu, max_len))
    out.loss.backward()
    return out.loss.detach()


ARMS = {  # arm -> (shared_prefix_training, shared_prefix_chunk_aligned)
    "packed": (False, False),
    "shared": (True, False),
    "aligned": (True, True),
}


def measure(model, arm: str, inputs, repeats: int, logprob: bool = False):
    ids, cu, max_len = inputs
    labels = None if logprob else boundary_labels(ids, cu)
    model.config.shared_prefix_training, model.config.shared_prefix_chunk_aligned = ARMS[arm]
    for _ in range(2):
        step(model, ids, cu, max_len, labels)
    walls, glue = [], []
    for _ in range(repeats):
        Timer.reset()
        t0 = time.thread_time()
        step(model, ids, cu, max_len, labels)
        wall = time.thread_time() - t0
        walls.append(wall * 1e3)
        glue.append((wall - Timer.spent) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(model, ids, cu, max_len, labels)
    counts = count_events(prof.events())
    reads = HostReads()
    with reads:
        step(model, ids, cu, max_len, labels)
    return {"counts": counts, "wall_ms": statistics.median(walls), "glue_ms": statistics.median(glue),
            "reads": reads.sites}


def per_layer(results, kind, arm, phase):
    """Launches of one layer of `kind` (gdn / attn): the model with one more such layer minus the base model."""
    return results[kind][arm]["counts"].launches[phase] - results["base"][arm]["counts"].launches[phase]


def layer_ops(results, kind, arm):
    out = collections.Counter()
    for phase in ("forward", "backward"):
        extra = results[kind][arm]["counts"].by_op[phase].copy()
        extra.subtract(results["base"][arm]["counts"].by_op[phase])
        for op, n in extra.items():
            if n:
                out[f"{phase[:3]} {op}"] += n
    return out


def parse_shape(text):
    try:
        n, p, r = (int(x) for x in text.split("x"))
    except ValueError:
        raise SystemExit(f"--shape: expected NxPxR (rollouts x prompt x response), got {text!r}") from None
    return n, p, r


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4x256x32", help="n rollouts x prompt x response tokens of a group")
    parser.add_argument("--groups", type=int, default=1, help="groups of that shape in the micro-batch (own prompts)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--conv-look-back", choices=CONV_LOOK_BACK, default="rows",
                        help="the shared conv's look-back: gathered rows, a state gathered around the call (fla), "
                             "or read by the kernels from x (our Triton conv); default: the torch reference's (rows)")
    parser.add_argument("--pass", dest="which", choices=("train", "logprob"), default="train",
                        help="a training step, or the log-prob pass (forward under no_grad, per-token log-probs)")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, p, r = parse_shape(args.shape)
    ids, cu, max_len, _ = batch([(n, p, r)] * args.groups, [], TINY["vocab_size"], "cpu")
    results = {}
    for kind, layer_types in MODELS.items():
        model = build(layer_types, not args.no_checkpointing, args.conv_look_back)
        results[kind] = {arm: measure(model, arm, (ids, cu, max_len), args.repeats, args.which == "logprob")
                         for arm in ARMS}
    lines = report(results, args, n, p, r)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return results


def report(results, args, n, p, r):
    arms = list(ARMS)
    lines = [(f"{args.which} pass, {args.groups} group(s) of n={n} P={p} R={r}, tiny widths, float32, torch {torch.__version__}, "
             f"checkpointing {'off' if args.no_checkpointing else 'on'}, conv look-back {args.conv_look_back}, "
             "1 thread; arms: packed, shared (default plan), aligned (shared_prefix_chunk_aligned)"),
             "launches = aten ops outside the op slots that launch a kernel on CUDA; slot calls = backend calls",
             "", f"{'':34}" + "".join(f" {a:>8}" for a in arms)]
    base = results["base"]

    def row(label, values):
        lines.append(f"{label:34}" + "".join(f" {values[a]:>8}" for a in arms))

    def layer(kind, phases=("forward", "backward")):
        return {a: sum(per_layer(results, kind, a, ph) for ph in phases) for a in arms}

    for kind, label in (("gdn", "GDN"), ("attn", "attention")):
        for phase in ("forward", "backward"):
            row(f"per {label} layer, {phase}", layer(kind, (phase,)))
    fixed = {a: base[a]["counts"].total() - layer("gdn")[a] - layer("attn")[a] for a in arms}
    row("per step outside the layers", fixed)
    for kind, label in (("gdn", "GDN"), ("attn", "attention")):
        row(f"slot calls per {label} layer", {a: results[kind][a]["counts"].total("slot_calls")
                                              - base[a]["counts"].total("slot_calls") for a in arms})
    for gdn, attn in ((6, 2), (24, 8)):
        row(f"per step at {gdn + attn} layers (estimate)",
            {a: fixed[a] + layer("gdn")[a] * gdn + layer("attn")[a] * attn for a in arms})
    lines += ["", f"host ms per step (CPU time of this thread, median of {args.repeats}), 2-layer model: "
              + ", ".join(f"{a} {base[a]['wall_ms']:.1f} (outside slots {base[a]['glue_ms']:.1f})" for a in arms)]
    lines.append("(CPU ms at tiny widths: the CPU's own kernels, such as a row-by-row index_add_, are in them, and a"
                 " shared 2-core host moves them by 2x; the launch counts above are what carries over to the GPU)")
    for kind, label in (("gdn", "GDN"), ("attn", "attention")):
        lines += ["", f"glue launches of one {label} layer by op ({', '.join(arms)}):"]
        per = {a: layer_ops(results, kind, a) for a in arms}
        ops = sorted(set().union(*per.values()), key=lambda o: (-per["shared"][o], o))
        for op in ops[: args.top]:
            lines.append(f"  {op:44}" + "".join(f" {per[a][op]:>5}" for a in arms))
    lines += ["", f"per step outside the layers by op ({', '.join(arms)}): the 2-layer model minus its two layers"]
    outside = {}
    for arm in arms:
        c = collections.Counter()
        for phase in ("forward", "backward"):
            for op, k in base[arm]["counts"].by_op[phase].items():
                c[f"{phase[:3]} {op}"] += k
        c.subtract(layer_ops(results, "gdn", arm))
        c.subtract(layer_ops(results, "attn", arm))
        outside[arm] = c
    for op in sorted(set().union(*outside.values()), key=lambda o: (-outside["shared"][o], o)):
        if any(outside[a][op] for a in arms):
            lines.append(f"  {op:44}" + "".join(f" {outside[a][op]:>5}" for a in arms))
    for arm in arms:
        reads = base[arm]["reads"]
        lines += ["", (f"host reads in one {arm} step outside the slots ({sum(reads.values())}; each a sync on a GPU "
                  "unless its tensor is on the host):")]
        for (name, site), k in sorted(reads.items(), key=lambda x: -x[1]):
            lines.append(f"  {k:>3} x .{name}  {site}")
    return lines


if __name__ == "__main__":
    main()
