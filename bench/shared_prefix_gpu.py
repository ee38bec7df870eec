"""Shared-prefix vs packed vs what a user would pick instead, training on one GPU, at 8 and 32 layers in one run.

    python bench/shared_prefix_gpu.py --out DIR [--shapes grid | 4x2048x256,split,...] [--layers 8,32]
    python bench/shared_prefix_gpu.py --tiny --out DIR   # CPU run of the script itself, tiny widths
    python bench/shared_prefix_gpu.py --graphs ...        # + the shared step without checkpointing, eager and
                                                          #   under CUDA graphs (shared_prefix_graphs.py)
    python bench/shared_prefix_gpu.py --graphs --vary 24  # + both over 24 micro-batches of drawn prompt and
                                                          #   response lengths (shared_prefix_vary.py)

Builds `Qwen3_5ForCausalLM` from the generated GPU module (hidden 2560, intermediate 9216, 16
attention heads of 256 with 4 KV heads, GDN 16/32 heads of 128, conv 4, vocab 151936), bf16,
activation checkpointing, random weights, once per `--layers` depth (pattern 3 linear + 1 full);
one process, so the depths share the compiled kernels. Per depth: the correctness check (bf16 flag
on vs off: logits and loss bit-identical, gradients against the packed-vs-unpacked floor), then
per shape (n rollouts of a P-token prompt with R-token responses, whole groups in one micro-batch)
the training step (forward + backward) and the log-prob pass (forward only) with the flag off
(`packed`) and on (`shared`); loss and log-probs of the two compared bit for bit; the host vs GPU
time of each training step (`shared_prefix_timing.py` says how); then, with only that model on the
GPU, the baselines (`shared_prefix_arms.py`): `upstream_liger` (transformers + liger's
`apply_liger_kernel_to_qwen3_5` + fla, the default) and `upstream` (transformers + fla).
Efficiency = speed-up over packed / its bound T / C. Writes `shared_prefix_<device><tag>.csv` (after
every shape, so a cut run keeps what it measured), `correctness_<device><tag>.csv` and the tables
as `shared_prefix_<device><tag>.md` under --out.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

import torch
from shared_prefix_arms import (  # noqa: F401 - re-exported for the other bench scripts
    ARMS,
    BASELINES,
    MODULE,
    TINY,
    WIDTHS,
    baseline_model,
    boundary_labels,
    checkpointed,
    config_for,
    liger_apply,
    logprob_pass,
    our_model,
    packed_kwargs,
    train_step,
)
from shared_prefix_buckets import add_bucket_knobs, apply_bucket_knobs
from shared_prefix_graphs import GRAPH_ARMS, graph_arms
from shared_prefix_graphs import summary as graphs_summary
from shared_prefix_report import ratios, table, write
from shared_prefix_shapes import (  # noqa: F401 - re-exported for the other bench scripts
    CONTROLS,
    GRID,
    TINY_SHAPES,
    Shape,
    batch,
    correctness_shapes,
    parse_shapes,
    shape_batch,
    tiny_shapes,
    tree_settings,
)
from shared_prefix_timing import (  # noqa: F401 - re-exported for the other bench scripts
    Repeats,
    Timer,
    count_syncs,
    counting_syncs,
    measure,
    plan_build_ms,
    profiler_cost_us,
    split_step,
)
from shared_prefix_vary import summary as vary_summary
from shared_prefix_vary import vary_arms

OURS = ("packed", "shared")


def _get(row, key):
    return row.get(key, float("nan"))


def set_tree(model, shape):
    tree = tree_settings(shape)
    model.config.shared_prefix_max_depth = tree["max_depth"]
    model.config.shared_prefix_level_cost = tree["level_cost"]


def run_arm(model, arm, row, inputs, args, device, timer, cost_us):
    """Time one arm's training step and log-prob pass into `row`; returns {kind: last output}.

    Per kind: warm-up calls, then (training step of an arm in `--host-split`) one profiled call for
    host vs GPU time, then the timed calls (the first also counts host syncs). A failure (an OOM, say)
    is recorded in the row, not fatal.
    """
    flag, train, logprob = ARMS[arm]
    if flag is not None:
        model.config.shared_prefix_training = flag
    repeats = (
        Repeats(args.upstream_repeats, 1, args.repeat_ms)
        if flag is None
        else Repeats(args.repeats, args.min_repeats, args.repeat_ms)
    )
    outputs = {}
    kinds = (("train", train), ("logprob", logprob))
    if flag is None and not args.baseline_logprob:
        kinds = kinds[:1]
    for kind, fn in kinds:
        key = f"{arm}_{kind}"
        try:
            for _ in range(args.warmup):
                fn(model, *inputs)
            if kind == "train" and arm in args.host_split:
                cut, _ = split_step(lambda step=fn: step(model, *inputs), device, cost_us)
                for field in ("host_ms", "gpu_ms", "wait_ms", "profiler_ms", "kernels"):
                    row[f"{arm}_{field}"] = getattr(cut, field)
                row[f"{arm}_profiled_wall_ms"] = cut.wall_ms
            m = measure(model, fn, inputs, timer, repeats, device)
            if kind == "train":
                row[f"syncs_{arm}_train"] = m.syncs
            outputs[kind] = m.result
        except Exception as error:  # noqa: BLE001 - the run goes on; the CSV says what failed
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            row[f"{key}_error"] = (
                f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
            )
            print(f"  {arm} {kind} failed: {row[f'{key}_error']}", flush=True)
            m = None
        nan = float("nan")
        row[f"{key}_ms"], row[f"{key}_min"], row[f"{key}_max"] = (
            (m.median, m.low, m.high) if m else (nan,) * 3
        )
        row[f"{key}_peak_gib"], row[f"{key}_step_gib"] = (m.peak_gib, m.step_gib) if m else (nan, nan)
        # the step's own memory: what it holds at its peak beyond the weights and its gradients (activations,
        # workspaces, the plan); weights and gradients are the same in every arm
        row[f"{key}_grads_gib"] = m.grads_gib if m else nan
        row[f"{key}_activation_gib"] = m.step_gib - m.grads_gib if m else nan
        row[f"{key}_repeats"] = m.count if m else 0
    if flag is not None:
        model.config.shared_prefix_training = False
    return outputs


def bit_equal(row, outputs):
    """Loss (training step) and log-probs (log-prob pass) of the shared arm bit for bit equal to packed's."""
    for kind, column in (("train", "loss_bitequal"), ("logprob", "logprobs_bitequal")):
        a, b = outputs["packed"].get(kind), outputs["shared"].get(kind)
        row[column] = "" if a is None or b is None else bool(a.shape == b.shape and torch.equal(a, b))
    for arm in OURS:
        loss = outputs[arm].get("train")
        row[f"loss_{arm}"] = float(loss) if loss is not None else float("nan")


def shape_row(shape, layers, vocab, device, chunk_aligned=False):
    """The row of one shape (depth, name, packed and compact lengths, bound, levels) and its packed inputs."""
    from patchgen.kernels.shared_prefix import build_plan

    ids, cu, max_len, _ = shape_batch(shape, vocab, device)
    plan = build_plan(ids, cu, **tree_settings(shape), chunk_aligned=chunk_aligned)
    compact = plan.compact_length if plan is not None else ids.shape[1]
    row = {
        "layers": layers,
        "shape": shape[0],
        "T": ids.shape[1],
        "C": compact,
        "bound": ids.shape[1] / compact,
        "levels": plan.depth if plan is not None else 0,
    }
    return row, (ids, cu, max_len)


def speed(model, shapes, rows, args, device, timer, vocab, cost_us, save):
    """Our two arms over every shape, into `rows` (one per shape), each saved as soon as it is measured."""
    for shape, row in zip(shapes, rows):
        _, inputs = shape_row(shape, row["layers"], vocab, device)
        set_tree(model, shape)
        outputs = {arm: run_arm(model, arm, row, inputs, args, device, timer, cost_us) for arm in OURS}
        bit_equal(row, outputs)
        if args.graphs:
            graph_arms(model, row, inputs, args, device, timer, cost_us, run_arm)
            if args.vary:
                vary_arms(model, shape, row, args, device, vocab)
        # The device cannot be busy longer than the step took: else the split misread the trace.
        for arm in OURS:
            if row.get(f"{arm}_gpu_ms", 0) > 1.05 * row.get(f"{arm}_train_ms", float("inf")):
                print(
                    f"  warning: {arm} GPU ms {row[f'{arm}_gpu_ms']:.0f} > its step {row[f'{arm}_train_ms']:.0f} ms"
                )
        row["plan_ms"] = plan_build_ms(inputs[0], inputs[1], device, **tree_settings(shape))
        ratios(row)
        save()
        get = functools.partial(_get, row)
        print(
            f"[{row['layers']}L] {row['shape']}: T={row['T']} C={row['C']} bound={row['bound']:.2f} train "
            f"{get('packed_train_ms'):.0f} -> {get('shared_train_ms'):.0f} ms (eff {get('efficiency_train'):.2f}), "
            f"logprob {get('packed_logprob_ms'):.0f} -> {get('shared_logprob_ms'):.0f} ms (eff "
            f"{get('efficiency_logprob'):.2f}), host/GPU ms packed {get('packed_host_ms'):.0f}/{get('packed_gpu_ms'):.0f}"
            f" shared {get('shared_host_ms'):.0f}/{get('shared_gpu_ms'):.0f}, peak {get('packed_train_peak_gib'):.1f} -> "
            f"{get('shared_train_peak_gib'):.1f} GiB (activations {get('packed_train_activation_gib'):.2f} -> "
            f"{get('shared_train_activation_gib'):.2f} GiB, gradients {get('shared_train_grads_gib'):.2f}), loss/log-probs bit-equal {row['loss_bitequal']}/"
            f"{row['logprobs_bitequal']}, syncs {row.get('syncs_packed_train')}/{row.get('syncs_shared_train')}",
            flush=True,
        )
        if args.graphs:
            print(graphs_summary(row), flush=True)
            if args.vary:
                print(vary_summary(row), flush=True)


def baseline_speed(twin, arm, shapes, rows, args, device, timer, vocab, cost_us, save):
    """One baseline arm over the same shapes, into the same rows."""
    for shape, row in zip(shapes, rows):
        _, inputs = shape_row(shape, row["layers"], vocab, device)
        run_arm(twin, arm, row, inputs, args, device, timer, cost_us)
        ratios(row)
        save()
        get = functools.partial(_get, row)
        print(
            f"[{row['layers']}L] {row['shape']}: {arm} train {get(f'{arm}_train_ms'):.0f} ms (ours packed "
            f"{get(f'packed_vs_{arm}_train'):.2f}x faster), peak "
            f"{get(f'{arm}_train_peak_gib'):.1f} GiB, syncs {row.get(f'syncs_{arm}_train')}",
            flush=True,
        )


# ---- correctness ---------------------------------------------------------------------------------


def grads_of(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def correctness_arm(model, ids, cu, max_len, flag, n_items):
    model.config.shared_prefix_training = flag
    model.zero_grad(set_to_none=True)
    labels = boundary_labels(ids, cu)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=n_items, **packed_kwargs(cu, max_len))
    out.loss.backward()
    return out.logits.detach().float(), out.loss.detach().float(), grads_of(model)


def run_unpacked(model, seqs, device, n_items):
    """Each sequence alone (no packing), losses summed with the packed normalisation."""
    model.config.shared_prefix_training = False
    model.zero_grad(set_to_none=True)
    logits, loss = [], 0.0
    for seq in seqs:
        ids = seq.unsqueeze(0).to(device)
        out = model(input_ids=ids, labels=ids, num_items_in_batch=n_items)
        out.loss.backward()
        logits.append(out.logits.detach().float())
        loss = loss + out.loss.detach().float()
    return torch.cat(logits, dim=1), loss, grads_of(model)


def distance(a, b):
    """(max |a-b|, ||a-b|| / ||b||) over tensors or dicts of tensors."""
    if isinstance(a, dict):
        pairs = [(a[k], b[k]) for k in b]
        num = sum((x - y).pow(2).sum() for x, y in pairs).sqrt()
        den = sum(y.pow(2).sum() for _, y in pairs).sqrt()
        return max((x - y).abs().max().item() for x, y in pairs), (num / den).item()
    return (a - b).abs().max().item(), ((a - b).norm() / b.norm()).item()


def correctness(model, device, vocab, shape, layers):
    """Flag on vs off on one `Shape` (a tree where it nests), against the packed-vs-unpacked floor.

    `bit_identical`: flag on equals flag off exactly (the claim for logits and loss in bf16);
    `within_2x_floor`: the gradients' claim (they differ in summation order only).
    """
    ids, cu, max_len, seqs = shape_batch(shape, vocab, device, seed=1)
    set_tree(model, shape)
    n_items = ids.shape[1] - len(seqs)  # shifted labels: one fewer per sequence
    off = correctness_arm(model, ids, cu, max_len, False, n_items)
    on = correctness_arm(model, ids, cu, max_len, True, n_items)
    alone = run_unpacked(model, seqs, device, n_items)
    rows = []
    for i, what in enumerate(("logits", "loss", "grads")):
        sp_max, sp_rel = distance(on[i], off[i])
        nf_max, nf_rel = distance(alone[i], off[i])
        rows.append(
            {
                "layers": layers,
                "shape": shape.name,
                "quantity": what,
                "shared_vs_packed_max": sp_max,
                "shared_vs_packed_rel": sp_rel,
                "noise_floor_max": nf_max,
                "noise_floor_rel": nf_rel,
                "bit_identical": sp_max == 0.0,
                "within_2x_floor": sp_rel <= 2 * max(nf_rel, 1e-30),
            }
        )
        print(
            f"[{layers}L] {shape.name}: {what:>6}: shared-vs-packed rel {sp_rel:.2e} (max {sp_max:.2e}); "
            f"packed-vs-unpacked rel {nf_rel:.2e} (max {nf_max:.2e})",
            flush=True,
        )
    model.config.shared_prefix_training = False
    return rows


# ---- the run ------------------------------------------------------------------------------------


def names(text: str, allowed, flag: str) -> list[str]:
    chosen = [item for item in text.split(",") if item]
    unknown = [item for item in chosen if item not in allowed]
    if unknown:
        raise SystemExit(
            f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)} (comma-separated, '' for none)"
        )
    return chosen


def depths(text: str) -> list[int]:
    try:
        layers = [int(v) for v in text.split(",") if v]
    except ValueError:
        layers = []
    if not layers or len(set(layers)) != len(layers):
        raise SystemExit(f"--layers: cannot read {text!r}; give distinct comma-separated depths, e.g. 8,32")
    return layers


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        default="grid",
        help="comma-separated n x P x R, 'split', 'system', 'system-tree', 'agentic', 'agentic-flat', "
        "'agentic-4', or 'grid' (all of them)",
    )
    parser.add_argument(
        "--layers", default="8,32", help="depths, comma-separated (one model each, one process)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per arm, kind and shape")
    parser.add_argument("--repeats", type=int, default=4, help="most timed calls of our arms")
    parser.add_argument("--min-repeats", type=int, default=2, help="fewest timed calls of our arms")
    parser.add_argument(
        "--repeat-ms",
        type=float,
        default=1000.0,
        help="stop timing a measurement once this many ms are timed and the fewest calls are made",
    )
    parser.add_argument("--upstream-repeats", type=int, default=1, help="most timed calls of a baseline")
    parser.add_argument(
        "--baselines",
        default=None,
        help=f"comma-separated baselines of {', '.join(BASELINES)} ('' for none; default upstream_liger, none with "
        "--tiny: upstream's PyTorch GDN refuses packed rows and liger needs a GPU)",
    )
    parser.add_argument(
        "--baseline-logprob",
        action="store_true",
        help="also time the baselines' log-prob pass (full logits, then log-softmax; off: the budget goes to the grid)",
    )
    parser.add_argument("--no-upstream", action="store_true", help="no baselines (same as --baselines '')")
    parser.add_argument(
        "--upstream-only",
        action="store_true",
        help="only the baselines (another GPU runs ours; the CSVs merge by shape)",
    )
    parser.add_argument(
        "--host-split",
        default="packed,shared",
        help="arms whose training step is split into host and GPU time (one profiled call per shape; '' for none)",
    )
    parser.add_argument(
        "--correctness",
        default="3x1990x96x300",
        help="comma-separated n x P x R x unrelated length cases and control shapes (system-tree); '' skips",
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument(
        "--tag", default="", help="suffix of the output names (runs split over GPUs or calls)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny widths and shapes on the CPU, float32 (script test)"
    )
    parser.add_argument(
        "--chunk-aligned",
        action="store_true",
        help="shared arm with shared_prefix_chunk_aligned (prefixes cut to whole GDN chunks, read in place)",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="also the shared step without checkpointing, eager and with shared_prefix_cuda_graphs "
        "(bench/shared_prefix_graphs.py; CUDA only)",
    )
    parser.add_argument(
        "--vary",
        type=int,
        default=0,
        help="with --graphs: also N micro-batches per shape with drawn prompt and response lengths, eager and "
        "graphed (captures vs replays and step ms under RL-like variation; bench/shared_prefix_vary.py)",
    )
    parser.add_argument(
        "--graphs-cache",
        type=int,
        default=None,
        metavar="N",
        help="with --graphs: graphs held per model (shared_prefix_cuda_graphs_cache, default 2); 1 where two "
        "uncheckpointed training graphs of the shape do not fit (32 layers, n=8 P=4096 under --vary)",
    )
    add_bucket_knobs(parser)
    parser.add_argument("--vary-prompt", type=float, default=0.1, help="--vary: prompt lengths in P (1 +- this)")
    parser.add_argument("--vary-response", type=float, default=0.5, help="--vary: response lengths in R (1 +- this)")
    args = parser.parse_args(argv)
    apply_bucket_knobs(args)
    if args.vary and not args.graphs:
        raise SystemExit("--vary varies the --graphs arms: give --graphs too")
    if args.graphs_cache is not None and not (args.graphs and args.graphs_cache >= 1):
        raise SystemExit(f"--graphs-cache {args.graphs_cache}: give a count of 1 or more, with --graphs")
    if args.graphs and args.tiny:
        raise SystemExit("--graphs needs a CUDA device: CUDA graphs do not run in the --tiny CPU run")
    if args.baselines is None:
        args.baselines = "" if args.tiny else "upstream_liger"
    args.baselines = [] if args.no_upstream else names(args.baselines, BASELINES, "--baselines")
    args.host_split = names(args.host_split, tuple(ARMS), "--host-split")
    args.layers = depths(args.layers)
    if args.graphs and args.host_split:
        args.host_split = [*args.host_split, *(a for a in GRAPH_ARMS if a not in args.host_split)]
    if args.upstream_only and not args.baselines:
        raise SystemExit(
            "--upstream-only with no baselines measures nothing; drop --no-upstream or give --baselines"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    # CUPTI left attached after a profiled call slows every later launch (kineto tears it down only
    # when asked on older releases): the timed calls after a host-vs-GPU split must not pay for it.
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    widths, vocab = (TINY if args.tiny else WIDTHS), (TINY if args.tiny else WIDTHS)["vocab_size"]
    shapes = tiny_shapes(args.shapes) if args.tiny else parse_shapes(args.shapes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = ("cpu-tiny" if args.tiny else torch.cuda.get_device_name().replace(" ", "_")) + args.tag
    path, checks_path, table_path = (
        out / f"shared_prefix_{label}.csv",
        out / f"correctness_{label}.csv",
        out / f"shared_prefix_{label}.md",
    )
    if "upstream_liger" in args.baselines:
        liger_apply()  # a missing liger fails here, before anything is measured
    timer = Timer(device)
    cost_us = profiler_cost_us(device) if args.host_split else float("nan")
    print(f"profiler cost per host event: {cost_us:.2f} us", flush=True)
    rows, checks, began = [], [], time.perf_counter()

    def save():
        write(rows, path)

    for layers in args.layers:
        depth_began = time.perf_counter()
        model = our_model(widths, layers, device, dtype)
        model.config.shared_prefix_chunk_aligned = args.chunk_aligned
        if args.graphs_cache is not None:
            model.config.shared_prefix_cuda_graphs_cache = args.graphs_cache
        if layers == args.layers[0]:
            from patchgen.kernels import ops

            print(ops.of(model).describe(), flush=True)
        if args.correctness:
            for shape in correctness_shapes(args.correctness, args.tiny):
                checks += correctness(model, device, vocab, shape, layers)
            write(checks, checks_path)
        depth_rows = [shape_row(shape, layers, vocab, device, args.chunk_aligned)[0] for shape in shapes]
        for row in depth_rows:
            row["profiler_cost_us"] = cost_us
        rows += depth_rows
        if not args.upstream_only:
            speed(model, shapes, depth_rows, args, device, timer, vocab, cost_us, save)
        if args.baselines:
            # Only one model on the device at a time, so that each arm's peak memory is its own.
            state = {k: v.to("cpu") for k, v in model.state_dict().items()}
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for arm in args.baselines:
                twin = baseline_model(arm, state, widths, layers, device, dtype)
                baseline_speed(twin, arm, shapes, depth_rows, args, device, timer, vocab, cost_us, save)
                del twin
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del state
        else:
            del model
        print(f"[{layers}L] done in {time.perf_counter() - depth_began:.0f} s", flush=True)
    report = table(rows, args.baselines)
    table_path.write_text(report + "\n")
    print(report)
    print(
        f"wrote {path}, {table_path}"
        + (f", {checks_path}" if checks else "")
        + f" in {time.perf_counter() - began:.0f} s"
    )


if __name__ == "__main__":
    main()
