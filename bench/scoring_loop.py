"""The log-prob pass as an RL trainer runs it: a loop over micro-batches, with no wait between calls.

    python bench/scoring_loop.py --layers 8 --shapes 4x2048x256,8x4096x256 --batches 8

One call timed on its own leaves the device idle while the host prepares it (the plan, the graph key, the
static load: `profile_shared_prefix.py --timeline`). In a trainer's scoring loop the host can prepare
micro-batch k + 1 while the device still runs k, unless something in the call waits for the device. A row
handed over on the device must be copied back to be planned, and that copy waits; a row handed over on the
host (`kernels/modeling/host_rows.py`, as `SharedPrefixGRPOTrainer` passes it) need not.

Per shape, `--batches` micro-batches of the shape, each with its own token ids (so no plan is reused), scored
back to back, the device synchronized once at the end; ms per micro-batch (median of `--repeats` loops) for:

- `packed` and `shared` (shared_prefix_cuda_graphs on; scoring forwards replay a graph, or with `--scoring eager`
  run eagerly on the unpadded plan), each with the rows on the
  device (`device rows`) and on the host (`host rows`); with `--eager` also `shared eager` (graphs off, rows on
  the host: no bucket padding, every kernel launched by the host);
- efficiency = (packed ms / shared ms) / (T / C), packed and shared with the same rows;
- whether host rows give the device rows' log-probs bit for bit, per arm, and shared the packed ones.

`--labels` scores as `SharedPrefixGRPOTrainer` does: shift labels on the responses, log-probs there only (the
head counts the labelled rows: on the host for host rows, with a sync for device rows). Shapes of whole groups.

`--vary` draws every micro-batch's prompt and response lengths as `shared_prefix_gpu.py --graphs --vary` does
(P (1 +- 0.1), R (1 +- 0.5)): a new layout every call, as in RL, where the scoring graphs replay held buckets (padded
to them) or capture; the report adds the graphs' captures, replays and eager calls over the timed loops, and T and
C become the
loop's means (the bound is their ratio: the loop's total tokens over its total compact rows).

`--mix` scores one loop of micro-batches drawn from every `--shapes` shape in a seeded random order (with
`--vary`, each varied): an RL dataset's prompts of very different lengths, where `--scoring auto` meets calls of very
different sizes in one model (its fixed part per call decides them apart).

Off CUDA (`--tiny`) the same loop runs at tiny widths: it checks the script, it measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import itertools
import random
import statistics
import time

import torch
from host_split import PROFILED
from patchgen.kernels.config import SCORING_MODES
from shared_prefix_arms import MODULE, WIDTHS, config_for, packed_kwargs
from shared_prefix_buckets import add_bucket_knobs, apply_bucket_knobs
from shared_prefix_graphs import uncheckpointed
from shared_prefix_shapes import parse_shapes, shape_batch, tree_settings
from shared_prefix_vary import varied_batches

VARY_PROMPT, VARY_RESPONSE = 0.1, 0.5  # --vary's spreads: shared_prefix_gpu.py --vary's defaults

TINY_WIDTHS = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, vocab_size=1000,
)


def score(model, ids, cu, max_len, shift_labels=None):
    """The log-prob pass (`shared_prefix_arms.logprob_pass`), whatever device its row is on; with `shift_labels`,
    as `SharedPrefixGRPOTrainer` calls it (log-probs of the response tokens only)."""
    labelled = {} if shift_labels is None else {"shift_labels": shift_labels, "labelled_positions_only": True}
    with torch.no_grad():
        return model(
            input_ids=ids, return_log_probs=True, return_logits=False, **packed_kwargs(cu, max_len), **labelled
        ).log_probs


def response_labels(ids: torch.Tensor, cu: torch.Tensor, response: int) -> torch.Tensor:
    """`shift_labels [1, T]`: the next token where it is one of a sequence's last `response` tokens, else -100
    (what the trainer scores: completions, not prompts)."""
    labels = torch.full_like(ids, -100)
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        first = max(start, end - response - 1)
        labels[0, first : end - 1] = ids[0, first + 1 : end]
    return labels


def loop_ms(model, batches, device) -> tuple[float, float, list]:
    """`_loop_ms`, with Python's collector off for the loop under `--gc-off` (callers collect before, outside any
    profile: `clean_slate`)."""
    was = gc.isenabled()
    if GC_OFF:
        gc.disable()
    try:
        return _loop_ms(model, batches, device)
    finally:
        if was:
            gc.enable()


def clean_slate() -> None:
    """Under `--gc-off`, collect once before a loop, so the loop starts with nothing the collector owes."""
    if GC_OFF:
        gc.collect()


GC_OFF = False  # --gc-off: a diagnostic A/B (does a collection of Python's garbage stall the host mid-loop?)


def _loop_ms(model, batches, device) -> tuple[float, float, list]:
    """ms per micro-batch of one loop over `batches` (the device synchronized at the end only), the host's ms
    per micro-batch until the last call returned, and the log-probs. Host ms close to the loop's: the host sets
    the pace (its own work, or a wait for the device inside a call); well below: the device does."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    begin = time.perf_counter()
    out = [score(model, *b) for b in batches]
    queued = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    return (end - begin) * 1e3 / len(batches), (queued - begin) * 1e3 / len(batches), out


def loop_timeline(model, module, batches, device, title: str) -> tuple[str, dict[str, float]]:
    """One loop profiled: the report (`idle_report` says what it shows) and the loop's device us per kernel name."""
    from pass_timeline import phases
    from shared_prefix_timing import events_of
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    clean_slate()
    with phases(module), collections() as seen, profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loop_ms(model, batches, device)
    done = ", ".join(f"generation {g}: {len(ms)} taking {sum(ms):.2f} ms" for g, ms in sorted(seen.items())) or "none"
    events = events_of(prof)
    report = idle_report(events, len(batches), title) + (
        f"\n  Python garbage collections while profiled (the loop, the profiler's start and stop): {done}")
    return report, kernel_us(events)


def kernel_us(events) -> dict[str, float]:
    """Device us per kernel name (copies and memsets under their kind's name) of a profile's records."""
    from pass_timeline import device_kind, device_records

    out: dict[str, float] = {}
    for e in device_records(events):
        kind = device_kind(e)
        name = e.name if kind == "kernel" else f"{kind}: {e.name}"
        out[name] = out.get(name, 0.0) + e.duration_ns / 1e3
    return out


@contextlib.contextmanager
def collections():
    """Each collection of Python's garbage while the block runs, as a profiler range `gc: generation N` (so a gap
    it stalled lists it among its host records) and in the yielded {generation: [ms, ...]}."""
    seen: dict[int, list[float]] = {}
    running = []

    def callback(phase, info):
        if phase == "start":
            scope = torch.profiler.record_function(f"gc: generation {info['generation']}")
            scope.__enter__()
            running.append((scope, time.perf_counter()))
        elif running:
            scope, began = running.pop()
            scope.__exit__(None, None, None)
            seen.setdefault(info["generation"], []).append((time.perf_counter() - began) * 1e3)

    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def idle_report(events, calls: int, title: str) -> str:
    """A profiled loop of `calls` forwards: wall, the device's busy time, its idle time grouped by what the host was
    doing when the device ran dry (the innermost phase of `pass_timeline.phases` and the CUDA call in flight), the
    longest gaps with the call of the loop they fell in, and the host records of 0.1 ms or more during the longest.
    In a loop the host runs ahead, so a gap is the device waiting for work the host has not queued yet."""
    from pass_timeline import device_kind, device_records, timeline

    t = timeline(events, min_gap_us=10.0)
    t0 = min(e.start_ns for e in events if e.host and e.name.startswith("phase: "))
    starts = sorted((e.start_ns - t0) / 1e6 for e in events if e.host and e.name == "phase: model")
    by_where: dict[tuple[str, str], list[float]] = {}
    for gap in t.gaps:
        by_where.setdefault((gap.phase, gap.call), []).append(gap.length_ms)
    idle = sum(g.length_ms for g in t.gaps)
    head = (f"--- {title}: wall {t.wall_ms:.2f} ms for {calls} calls, device busy {t.busy_ms:.2f} ms, first kernel "
            f"at {t.first_kernel_ms:.2f} ms, idle in gaps >= 10 us: {idle:.2f} ms ({idle / calls:.2f} a call)")
    kinds: dict[str, float] = {}
    for e in device_records(events):
        kind = device_kind(e)
        kinds[kind] = kinds.get(kind, 0.0) + e.duration_ns / 1e6
    by_kind = ", ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]))
    lines = [head, f"  device ms by kind (summed, overlaps counted twice): {by_kind}",
             "  idle ms  gaps  longest ms  host phase at the gap's start / CUDA call in flight"]
    for (phase, call), lengths in sorted(by_where.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {sum(lengths):7.2f} {len(lengths):5d} {max(lengths):11.2f}  {phase} / {call or '-'}")
    lines.append("  longest gaps: call of the loop, ms into it, length ms, host phase / CUDA call")
    longest = sorted(t.gaps, key=lambda g: -g.length_ms)[:6]
    for gap in longest:
        k = max(0, sum(start <= gap.start_ms for start in starts) - 1)
        lines.append(f"    call {k}  {gap.start_ms - starts[k]:8.2f} {gap.length_ms:8.2f}  {gap.phase} / {gap.call or '-'}")
    if longest:  # what the host ran while the device waited the longest
        gap = longest[0]
        a, b = t0 + gap.start_ms * 1e6, t0 + (gap.start_ms + gap.length_ms) * 1e6
        inside = [e for e in events if e.host and e.duration_ns >= 1e5 and e.start_ns < b and e.start_ns + e.duration_ns > a]
        lines.append(f"  host records of 0.1 ms or more during the longest gap ({len(inside)}; start ms into the gap, ms):")
        for e in sorted(inside, key=lambda e: e.start_ns)[:40]:
            lines.append(f"    {(e.start_ns - a) / 1e6:8.2f} {e.duration_ns / 1e6:8.2f}  {e.name[:90]}")
    return "\n".join(lines)


def micro_batches(shape, count: int, vocab: int, device, labels: bool = False, vary: bool = False) -> tuple[list, list]:
    """`count` batches of `shape`, each with its own ids: on the device, and the same on the host (with
    `labels`, each with its responses' shift labels; with `vary`, each with drawn prompt and response lengths)."""
    on_device, on_host = [], []
    if vary:
        drawn = varied_batches(shape, count, vocab, "cpu", VARY_PROMPT, VARY_RESPONSE)
    for seed in range(count):
        ids, cu, max_len = drawn[seed] if vary else shape_batch(shape, vocab, "cpu", seed=seed)[:3]
        row = (ids, cu, max_len) + ((response_labels(ids, cu, shape[1][0][2]),) if labels else ())
        on_host.append(row)
        on_device.append(tuple(t.to(device) if torch.is_tensor(t) else t for t in row))
    return on_device, on_host


def mixed_batches(shapes, count: int, vocab: int, device, labels: bool = False, vary: bool = False):
    """`count` micro-batches, each of a shape drawn from `shapes` (seeded), as `micro_batches` makes them."""
    made = [micro_batches(shape, count, vocab, device, labels, vary) for shape in shapes]
    taken = [0] * len(shapes)
    on_device, on_host = [], []
    for i in random.Random(0).choices(range(len(shapes)), k=count):
        on_device.append(made[i][0][taken[i]])
        on_host.append(made[i][1][taken[i]])
        taken[i] += 1
    return on_device, on_host


def measure_shape(model, shape, args, device, module, given=None, name=None) -> dict:
    """The arms over `shape`'s micro-batches (or those `given`, `(on_device, on_host)`, under `name`)."""

    from patchgen.kernels.modeling.layer_graphs import use_graphs
    from patchgen.kernels.modeling.shared_prefix import observe_plans

    tree = tree_settings(shape)
    model.config.shared_prefix_max_depth = tree["max_depth"]
    model.config.shared_prefix_level_cost = tree["level_cost"]
    model.config.shared_prefix_chunk_aligned = args.chunk_aligned == "on"
    from patchgen.kernels.modeling.layer_graphs import graphs_of

    on_device, on_host = given or micro_batches(shape, args.batches, model.config.vocab_size, device, args.labels,
                                                  args.vary)
    rows = {"device rows": on_device, "host rows": on_host}
    sizes = {}
    result = {"shape": name or shape[0]}
    outputs = {}
    # (arm, shared-prefix flag, CUDA graphs); `shared eager` only with rows on the host: can a loop that never
    # waits hide eager launching behind the device's work, and save the graphs' bucket padding?
    arms = [("packed", False, False), ("shared", True, device.type == "cuda")]
    if args.eager:
        arms.append(("shared eager", True, False))
    for arm, flag, graphs in arms:
        model.config.shared_prefix_training = flag
        model.config.shared_prefix_cuda_graphs = graphs
        model.config.shared_prefix_cuda_graphs_scoring = args.scoring
        for where, batches in rows.items():
            if arm == "shared eager" and where == "device rows":
                continue
            seen = []  # (T, C) of every plan the warm loop builds: the loop's means set the bound
            with observe_plans(lambda plan, tokens, seen=seen: seen.append((tokens, plan.layout.compact_length if plan else tokens))):
                clean_slate()
                loop_ms(model, batches, device)  # warm: captures, tuning, first-use verification
            if arm == "shared" and seen:
                sizes.update(T=statistics.mean(t for t, _ in seen), C=statistics.mean(c for _, c in seen))
            held = graphs_of(model)
            before = (held.stats.captures, held.stats.replays, held.stats.eager) if held is not None else None
            times, host, out = [], [], None
            for _ in range(args.repeats):
                clean_slate()
                ms, queued, out = loop_ms(model, batches, device)
                times.append(ms)
                host.append(queued)
            if before is not None:
                result[f"{arm} {where} captures"] = held.stats.captures - before[0]
                result[f"{arm} {where} replays"] = held.stats.replays - before[1]
                result[f"{arm} {where} eager"] = held.stats.eager - before[2]
                result[f"{arm} {where} choice"] = held.choice.describe()  # what "auto" learnt (cumulative)
            if args.timeline and where == "host rows":  # main refuses --timeline off CUDA
                report, kernels = loop_timeline(model, module, batches, device, f"{shape[0]} {arm}, {where}")
                result.setdefault("timelines", []).append(report)
                result.setdefault("loop kernels", {})[arm] = kernels
            if args.host_split and where == "host rows":
                from host_split import host_split, profiled

                clean_slate()
                with host_split(module) as split:
                    loop_ms(model, batches, device)
                result.setdefault("timelines", []).append(split.report(f"{shape[0]} {arm}, {where}"))
                for what in args.profile_in if arm == "shared" else ():
                    clean_slate()
                    with profiled(what) as profile:
                        loop_ms(model, batches, device)
                    result["timelines"].append(profile())
            result[f"{arm} {where} ms"] = statistics.median(times)
            result[f"{arm} {where} host ms"] = statistics.median(host)
            outputs[(arm, where)] = out
        if (arm, "device rows") in outputs:
            result[f"{arm} host rows bit-equal"] = all(
                torch.equal(a, b) for a, b in zip(outputs[(arm, "host rows")], outputs[(arm, "device rows")])
            )
        if graphs:
            use_graphs(model.model, None)
        model.config.shared_prefix_training = False
        model.config.shared_prefix_cuda_graphs = False
    result["shared bit-equal to packed"] = all(
        torch.equal(a, b) for a, b in zip(outputs[("shared", "host rows")], outputs[("packed", "host rows")])
    )
    result["T"], result["C"] = sizes["T"], sizes["C"]
    bound = sizes["T"] / sizes["C"]
    kernels = result.get("loop kernels", {})
    if {"packed", "shared"} <= set(kernels):
        from kernel_groups import heaviest_excess
        from kernel_groups import table as group_table

        # the loop's device time per op group, shared against packed, both arms profiled the same way
        ratio = sizes["C"] / sizes["T"]
        result["timelines"].append(f"--- {shape[0]}: the loop's device time per op group\n"
                                   + group_table(kernels["packed"], kernels["shared"], ratio)
                                   + "\n  the kernels most of that excess is made of:\n"
                                   + heaviest_excess(kernels["packed"], kernels["shared"], ratio))
    for where in rows:
        result[f"efficiency {where}"] = result[f"packed {where} ms"] / result[f"shared {where} ms"] / bound
    if "shared eager host rows ms" in result:
        result["efficiency eager host rows"] = result["packed host rows ms"] / result["shared eager host rows ms"] / bound
        # the graphs run the plan padded to a bucket: equal to the eager pass up to the GEMMs' bf16 rounding over
        # more rows (bit-equal where nothing is padded, as off CUDA)
        result["shared eager bit-equal to shared"] = all(
            torch.equal(a, b) for a, b in zip(outputs[("shared eager", "host rows")], outputs[("shared", "host rows")])
        )
    return result


PLACEHOLDER_SCANS = ("plain", "pytree")


def use_placeholder_scan(way: str) -> None:
    """Set the layer tape's placeholder scan for this process (`--placeholder-scan`): `graph_tape.py`'s own, or the
    way before it (torch's pytree walks for every call on a placeholder, and `Tape.linear` reading the weight's
    metadata through the placeholder: three more dispatches a linear)."""
    from patchgen.kernels.shared_prefix import graph_tape
    from torch.utils._pytree import tree_map_only

    plain = PLAIN_SCAN.setdefault("functions", (graph_tape._real, graph_tape._placeholders, graph_tape.Tape.linear))
    if way == "plain":
        graph_tape._real, graph_tape._placeholders, graph_tape.Tape.linear = plain
        return
    real_linear = plain[2]

    def walked_real(args):
        return tree_map_only(graph_tape.Placeholder, graph_tape._weight_of, args)

    def walked_placeholders(args, kwargs):
        found = []
        tree_map_only(graph_tape.Placeholder, found.append, (args, kwargs))
        return found

    def linear_reading_through(self, x, held):
        held.dtype, held.shape, held.dtype  # noqa: B018 - the old tape's reads, each a dispatch of its own
        return real_linear(self, x, held)

    graph_tape._real, graph_tape._placeholders, graph_tape.Tape.linear = walked_real, walked_placeholders, \
        linear_reading_through


PLAIN_SCAN: dict = {}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x2048x256,8x4096x256")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", type=int, default=8, help="micro-batches per loop")
    parser.add_argument("--repeats", type=int, default=3, help="timed loops per arm (median)")
    parser.add_argument("--tiny", action="store_true", help="tiny widths on the CPU: checks the script, measures nothing")
    parser.add_argument("--eager", action="store_true",
                        help="also the shared arm without CUDA graphs (rows on the host): no bucket padding, eager launches")
    parser.add_argument("--labels", action="store_true",
                        help="score the responses only, with shift labels, as SharedPrefixGRPOTrainer calls the model")
    parser.add_argument("--timeline", action="store_true",
                        help="profile one loop per arm (rows on the host): the device's idle time and what the host did then")
    parser.add_argument("--min-calls", type=int, default=None, metavar="K",
                        help="A/B: the fewest layers of a kind left, the captured one included, for a layer graph's "
                             "capture (call_graphs.MIN_CALLS_TO_CAPTURE, default 3); 1 captures wherever a second "
                             "layer of a kind runs, as before the rule")
    parser.add_argument("--first-calls", choices=("capture", "eager"), default=None,
                        help="A/B: a pass's first layer of a kind captured once a pass of its kind has run (capture, "
                             "call_graphs.CAPTURE_FIRST_CALLS, the default) or always eager, as before capture_guard.py")
    parser.add_argument("--chunk-aligned", choices=("on", "off"), default="off",
                        help="A/B: the shared arm's plan with shared_prefix_chunk_aligned (prefixes cut to whole GDN "
                             "chunks, the rounds read in place: no gathers, up to 63 rows more per member)")
    parser.add_argument("--placeholder-scan", choices=PLACEHOLDER_SCANS, default=None,
                        help="A/B: the layer tape's placeholders check their arguments by a plain scan (plain, "
                             "graph_tape.py's) or by torch's pytree walks, and the tape reads a weight's metadata "
                             "through the placeholder (pytree, as before the fifteenth session)")
    parser.add_argument("--host-split", action="store_true",
                        help="one more loop per arm (rows on the host) with the host's time per forward split by phase "
                             "and by what each layer did, by the clock (`host_split.py`)")
    add_bucket_knobs(parser)
    parser.add_argument("--scoring", choices=SCORING_MODES, default="graphs",
                        help="the graphed arm's shared_prefix_cuda_graphs_scoring: a replay on a padded plan (graphs, the "
                             "default), eagerly on the unpadded plan (eager), or per call the way measured faster (auto)")
    parser.add_argument("--vary", action="store_true",
                        help="micro-batches of drawn prompt and response lengths (a new layout every call, as in RL)")
    parser.add_argument("--mix", action="store_true",
                        help="one loop of micro-batches drawn from every --shapes shape in a seeded random order (prompts "
                             "of very different lengths in one model)")
    parser.add_argument("--profile-in", action="append", default=[], choices=sorted(PROFILED),
                        help="with --host-split: one more shared loop with cProfile inside every call of this function "
                             "only (host_split.PROFILED: plan, capture, replay, layer); may repeat")
    parser.add_argument("--plan-profile", action="append_const", dest="profile_in", const="plan",
                        help="the same as --profile-in plan")
    parser.add_argument("--gc-off", action="store_true",
                        help="diagnostic: Python's garbage collector off during each loop (collected before it)")
    args = parser.parse_args(argv)
    global GC_OFF
    GC_OFF = args.gc_off
    apply_bucket_knobs(args)
    if args.min_calls is not None:
        if args.min_calls < 1:
            raise SystemExit(f"--min-calls: {args.min_calls} is below 1 (a capture serves at least its own layer)")
        from patchgen.kernels.shared_prefix import call_graphs

        call_graphs.MIN_CALLS_TO_CAPTURE = args.min_calls
        print(f"layer graphs capture with {args.min_calls} or more layers of a kind left", flush=True)
    if args.first_calls is not None:
        from patchgen.kernels.shared_prefix import call_graphs

        call_graphs.CAPTURE_FIRST_CALLS = args.first_calls == "capture"
        print(f"layer graphs: a pass's first layer of a kind {'captured' if args.first_calls == 'capture' else 'eager'} "
              "once a pass of its kind has run", flush=True)
    if args.placeholder_scan is not None:
        use_placeholder_scan(args.placeholder_scan)
        print(f"layer tape: placeholders scanned by {args.placeholder_scan}", flush=True)
    if args.vary and args.labels:
        raise SystemExit("--vary draws each response's length, --labels scores the shape's fixed R: give one of them")
    if args.timeline and (args.tiny or not torch.cuda.is_available()):
        raise SystemExit("--timeline profiles the device's idle time: it needs a CUDA device (and not --tiny)")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    with torch.device(device):
        model = module.Qwen3_5ForCausalLM(config_for(TINY_WIDTHS if args.tiny else WIDTHS, args.layers))
    model = (model if args.tiny else model.bfloat16()).eval()
    uncheckpointed(model)
    # which code ran: the backends of every slot, and where the package was imported from (a warm machine once
    # ran a previous call's staged copy)
    table = module.ops.of(model)
    print(f"{module.__file__}: " + ", ".join(f"{slot}={c.backend}" for slot, c in table.choices.items()), flush=True)
    print("run: " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in sorted(vars(args).items())), flush=True)
    results = []
    shapes = parse_shapes(args.shapes)
    if args.vary and any(getattr(shape, "turns", ()) for shape in shapes):
        raise SystemExit("--vary draws one prompt and response length per group: multi-turn shapes are not varied")
    if args.mix and (len(shapes) < 2 or any(tree_settings(shape) != tree_settings(shapes[0]) for shape in shapes)):
        raise SystemExit("--mix draws from two or more --shapes of one kind (GRPO groups: n x P x R), say 4x512x256,"
                         "8x4096x256")
    runs = [(shape, None, None) for shape in shapes]
    if args.mix:
        mixed = mixed_batches(shapes, args.batches, model.config.vocab_size, device, args.labels, args.vary)
        runs = [(shapes[0], mixed, "mix of " + " + ".join(shape[0] for shape in shapes))]
    for shape, batches, name in runs:
        r = measure_shape(model, shape, args, device, module, batches, name)
        results.append(r)
        print(
            f"[{args.layers}L] {r['shape']}{' varied' if args.vary else ''}: T={r['T']:.0f} C={r['C']:.0f} "
            f"{'(means) ' if args.vary or args.mix else ''}bound {r['T'] / r['C']:.2f}, "
            f"{args.batches} micro-batches a loop | device rows: packed {r.get('packed device rows ms'):.1f} / shared "
            f"{r.get('shared device rows ms'):.1f} ms (host {r.get('shared device rows host ms'):.1f}), eff "
            f"{r.get('efficiency device rows'):.2f} | host rows: packed {r.get('packed host rows ms'):.1f} / shared "
            f"{r.get('shared host rows ms'):.1f} ms (host {r.get('shared host rows host ms'):.1f}), eff "
            f"{r.get('efficiency host rows'):.2f} | host rows bit-equal: packed {r['packed host rows bit-equal']}, "
            f"shared {r['shared host rows bit-equal']}; shared bit-equal to packed {r['shared bit-equal to packed']}",
            flush=True,
        )
        if "shared host rows captures" in r:
            print(f"    graphs over the {args.repeats} timed loops (scoring {args.scoring}), host rows: "
                  f"{r['shared host rows captures']} captures, {r['shared host rows replays']} replays, "
                  f"{r['shared host rows eager']} eager; device rows: {r.get('shared device rows captures')} captures, "
                  f"{r.get('shared device rows replays')} replays, {r.get('shared device rows eager')} eager", flush=True)
            if args.scoring == "auto":
                print(f"    {r.get('shared host rows choice')}", flush=True)
        if "efficiency eager host rows" in r:
            print(f"    shared without graphs, host rows: {r['shared eager host rows ms']:.1f} ms (host "
                  f"{r['shared eager host rows host ms']:.1f}), eff {r['efficiency eager host rows']:.2f}, bit-equal to "
                  f"the graphed pass {r['shared eager bit-equal to shared']}", flush=True)
        from patchgen.kernels.shared_prefix.call_graphs import CALL_GRAPHS, LAYER_GRAPHS

        print(f"    call graphs (GDN rounds, conv; enabled {CALL_GRAPHS.enabled}) so far: {CALL_GRAPHS.captures} captures, "
              f"{CALL_GRAPHS.replays} replays; layer graphs (enabled {LAYER_GRAPHS.enabled}): {LAYER_GRAPHS.captures} "
              f"captures, {LAYER_GRAPHS.replays} replays, {LAYER_GRAPHS.not_warm} first-layer captures dropped (a "
              "kernel or table not made yet)", flush=True)
        for text in r.get("timelines", ()):
            print(text, flush=True)
    return results


if __name__ == "__main__":
    main()
