"""What CUDA graphs over the decoder-layer stack would give the training step (issue 15), on one replayed micro-batch.

    python bench/graphed_step.py [--shape 4x2048x256] [--layers 8] [--arms packed,shared] [--out DIR]
    python bench/graphed_step.py --tiny      # CPU: the eager parts at tiny widths, float32 (no graphs off CUDA)

The model is `bench/shared_prefix_gpu.py`'s (4B widths, bf16, random weights, same op slots) WITHOUT
activation checkpointing: `torch.cuda.make_graphed_callables` does not capture a recompute. The
bench replays one micro-batch, so every shape is static. Per arm (`packed`: flag off, `shared`:
flag on), all timed as forward + backward with gradients kept as buffers (`static_stack.zero_grads`):

- `ckpt`: the model's own step with activation checkpointing (the bench's step today), for reference;
- `eager`: the model's own step without checkpointing (its forward builds the plan and checks the
  boundaries on the host every step);
- `static`: embedding, the layer stack on the arguments recorded once by `static_stack.probe` (plan,
  packed row, cos/sin), final norm, LM head + loss: no host work from the batch left in the step;
- `graphed_stack` / `graphed_layer` (`--granularity stack,layer`; default stack): the same with the
  layer stack captured by `make_graphed_callables`, one graph forward and one backward for all layers,
  or one per layer; the embedding, norm and LM head + loss stay eager (liger's fused cross-entropy
  reads a host count).

Checks, per arm: the static step's loss and gradients against the model's own step; the graphed
step's against the eager step's, over two accumulated micro-batches (loss x 1, then x 2: a graph
whose gradient buffers were handed to `.grad` would double the second); each against the run-to-run
difference of two eager steps (the floor: `index_add_` and atomics are not deterministic on CUDA).
Before capture, one eager pass of the stack runs under `torch.cuda.set_sync_debug_mode("error")`:
the first host sync inside the layers (forward or backward) is printed with its call site (on the
CPU: every host read, `host_ops.HostReads`). A failed capture is printed with the op it failed at,
and the run goes on with the next arm. Peak memory: allocated, and reserved (a graph's private pool
is reserved, not allocated, between replays). Host vs GPU ms per step as in `shared_prefix_timing.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shared_prefix_arms import TINY, WIDTHS, checkpointed, our_model
from shared_prefix_gpu import depths, names, set_tree
from shared_prefix_shapes import TINY_SHAPES, parse_shapes, shape_batch
from shared_prefix_timing import GIB, Repeats, Timer, measure, profiler_cost_us, split_step, sync_sites
from static_stack import (
    LayerStack,
    grads_of,
    largest_difference,
    model_step,
    probe,
    stack_of,
    static_step,
)

ARMS = {"packed": False, "shared": True}
CPU_BACKENDS = ("kernels/reference/", "kernels/backends/")  # where the CPU's own slot backends live
GRANULARITIES = ("stack", "layer")


def uncheckpointed(model):
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    return model


OUTSIDE = ("/torch/", "/triton/")  # frames of the machinery, not of the code that called it


def _where(frame) -> str:
    return f"{frame.filename.split('site-packages/')[-1].split('/wt/')[-1]}:{frame.lineno} {frame.name}"


def first_site(error: BaseException) -> str:
    """The two innermost frames of `error`'s traceback outside torch and Triton (the op and its caller)."""
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if not any(o in f.filename for o in OUTSIDE)
    ]
    if not frames:
        return "?"
    return " <- ".join(f"{_where(f)}: {(f.line or '').strip()}" for f in reversed(frames[-2:]))


def describe(error: BaseException) -> str:
    text = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{type(error).__name__}: {text} [at {first_site(error)}]"


class Chain(torch.nn.Module):
    """Per-layer graphed callables run one after the other (`--granularity layer`)."""

    def __init__(self, parts):
        super().__init__()
        self.parts = list(parts)  # graphed modules; not registered (their parameters are the model's)

    def forward(self, hidden, cos, sin):
        for part in self.parts:
            hidden = part(hidden, cos, sin)
        return hidden


def sample_hidden(model, batch) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model.embed_tokens(batch.embed_ids)
    return hidden.detach().requires_grad_(True)


def graphed_stack(model, batch, granularity: str, warmup: int):
    """The layer stack under `make_graphed_callables` (warm-up iterations on a side stream, then capture)."""
    layers, kwargs = list(model.model.layers), batch.layer_kwargs
    if granularity == "stack":
        sample = (sample_hidden(model, batch), batch.cos, batch.sin)
        return torch.cuda.make_graphed_callables(LayerStack(layers, kwargs), sample, num_warmup_iters=warmup)
    parts = tuple(LayerStack([layer], [kw]) for layer, kw in zip(layers, kwargs))
    samples = tuple((sample_hidden(model, batch), batch.cos, batch.sin) for _ in parts)
    return Chain(torch.cuda.make_graphed_callables(parts, samples, num_warmup_iters=warmup))


def caller_outside_torch() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        if (
            any(o in frame.filename for o in OUTSIDE)
            or frame.filename == __file__
            or "/warnings.py" in frame.filename
        ):
            continue
        return _where(frame)
    # warnings of C++ autograd nodes are replayed on the calling thread after the backward
    return "no Python frame (a C++ op, e.g. an autograd node of the backward)"


def stack_host_syncs(model, batch, device) -> str:
    """'none', or the host syncs (CUDA) / host reads (CPU) of one eager forward + backward of the layer stack.

    On CUDA: torch's sync debug mode warns at every synchronising call; each warning is attributed to
    the innermost Python frame outside torch (a backend's launcher, our glue), forward and backward.
    """
    stack = stack_of(model, batch)
    hidden = sample_hidden(model, batch)
    if device.type == "cuda":
        import collections

        try:
            with sync_sites(caller_outside_torch) as found:
                out = stack(hidden, batch.cos, batch.sin)
                out.backward(torch.ones_like(out))
            torch.cuda.synchronize()  # outside the count: the backward's replayed warnings are in by now
        finally:
            model.zero_grad(set_to_none=True)
        sites = collections.Counter(found)
        return "; ".join(f"{n}x at {site}" for site, n in sites.most_common()) or "none"
    from host_ops import HostReads

    reads = HostReads()
    with reads:
        out = stack(hidden, batch.cos, batch.sin)
        out.backward(torch.ones_like(out))
    model.zero_grad(set_to_none=True)
    # The CPU's backends are not the GPU's (the sync debug mode checks those on the device): a read
    # inside one of them is listed apart, and only the glue around the slots counts.
    glue, backend = [], []
    for (name, site), n in reads.sites.items():
        (backend if any(d in site for d in CPU_BACKENDS) else glue).append(f"{n}x {name} at {site}")
    return "; ".join(glue) or "none" + (f" (CPU backends' own: {'; '.join(backend)})" if backend else "")


def two_micro_batches(model, step) -> tuple[torch.Tensor, dict]:
    """(first loss, gradients) of `step` over two accumulated micro-batches: loss x 1, then x 2."""
    loss = step(scale=1.0, zero=True)
    step(scale=2.0, zero=False)
    return loss, grads_of(model)


def compare(reference, other) -> tuple[bool, float, str]:
    """(bit-equal, max |grad difference|, where) of two `two_micro_batches` results."""
    (loss_a, grads_a), (loss_b, grads_b) = reference, other
    diff, where = largest_difference(grads_b, grads_a)
    same_loss = bool(torch.equal(loss_a, loss_b))
    if not same_loss:
        where = f"loss {loss_a.item():.6g} vs {loss_b.item():.6g}; {where}"
    return same_loss and diff == 0.0, diff, where


def timed(model, fn, args, row, key, ctx):
    """Warm-up, then the median of the timed calls, peak memory and (CUDA) the host vs GPU split, into `row`."""
    for _ in range(ctx.args.warmup):
        fn(model, *args)
    m = measure(model, fn, args, ctx.timer, ctx.repeats, ctx.device)
    row[f"{key}_ms"], row[f"{key}_min"], row[f"{key}_max"] = m.median, m.low, m.high
    row[f"{key}_peak_gib"], row[f"{key}_step_gib"] = m.peak_gib, m.step_gib
    if ctx.device.type == "cuda":
        row[f"{key}_reserved_gib"] = torch.cuda.memory_reserved() / GIB
        row[f"{key}_syncs"] = m.syncs
    if ctx.args.host_split and ctx.device.type == "cuda":
        try:
            cut, _ = split_step(lambda: fn(model, *args), ctx.device, ctx.cost_us)
        except Exception as error:  # noqa: BLE001 - the profiler failing on a step is no verdict on the step
            row[f"{key}_split_error"] = describe(error)
        else:
            row[f"{key}_host_ms"], row[f"{key}_gpu_ms"], row[f"{key}_kernels"] = (
                cut.host_ms,
                cut.gpu_ms,
                cut.kernels,
            )
    model.zero_grad(set_to_none=True)


def run_arm(model, arm, inputs, ctx) -> dict:
    ids, cu, max_len = inputs
    model.config.shared_prefix_training = ARMS[arm]
    row = {"arm": arm, "layers": ctx.layers, "shape": ctx.shape.name}

    def own(m, *a):
        return model_step(m, *a)

    if ctx.args.ckpt:
        checkpointed(model)
        timed(model, own, inputs, row, "ckpt", ctx)
        uncheckpointed(model)
    timed(model, own, inputs, row, "eager", ctx)
    eager = lambda **kw: model_step(model, ids, cu, max_len, **kw)
    # Every step of the model's own forward comes before the capture: its new plan per step would push
    # the recorded plan's chunk tables out of fla's identity cache, and the graph reads those (see docs).
    reference = two_micro_batches(model, eager)
    _, row["floor"], _ = compare(reference, two_micro_batches(model, eager))
    batch = probe(model, ids, cu, max_len)
    row["C"] = batch.embed_ids.shape[1]
    stack = stack_of(model, batch)
    static = lambda **kw: static_step(model, stack, batch, **kw)
    row["static_equal"], row["static_diff"], row["static_where"] = compare(
        reference, two_micro_batches(model, static)
    )
    timed(model, lambda m, s, b: static_step(m, s, b), (stack, batch), row, "static", ctx)
    row["stack_syncs"] = stack_host_syncs(model, batch, ctx.device)
    for granularity in ctx.args.granularity:
        graph_arm(model, batch, reference, granularity, row, ctx)
    return row


def graph_arm(model, batch, reference, granularity: str, row: dict, ctx) -> None:
    """Capture the stack at `granularity`, check its step against `reference` and time it, into `row`."""
    key = f"graphed_{granularity}"
    if ctx.device.type != "cuda":
        row[f"{key}_error"] = "skipped: CUDA graphs need a CUDA device"
        return
    graphed = None
    torch.cuda.empty_cache()  # the eager steps' cached blocks back to the device before the graph's pool
    try:
        began = time.perf_counter()
        graphed = graphed_stack(model, batch, granularity, ctx.args.graph_warmup)
        row[f"{key}_capture_s"] = time.perf_counter() - began
        with_graph = lambda **kw: static_step(model, graphed, batch, **kw)
        result = two_micro_batches(model, with_graph)
        row[f"{key}_equal"], row[f"{key}_diff"], row[f"{key}_where"] = compare(reference, result)
        timed(model, lambda m, g, b: static_step(m, g, b), (graphed, batch), row, key, ctx)
    except Exception as error:  # noqa: BLE001 - the next arm still runs; the row says what failed
        row[f"{key}_error"] = describe(error)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
    finally:
        graphed = None  # the graph and its pool go before the next one
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def summary(row) -> str:
    def ms(key):
        value = row.get(f"{key}_ms")
        return "-" if value is None else f"{value:.1f}"

    def split(key):
        syncs = f", {row[f'{key}_syncs']} syncs" if f"{key}_syncs" in row else ""
        if f"{key}_split_error" in row:
            return f" (host/GPU split failed: {row[f'{key}_split_error']}{syncs})"
        if f"{key}_host_ms" not in row:
            return f" ({syncs[2:]})" if syncs else ""
        return (
            f" (host {row[f'{key}_host_ms']:.0f} / GPU {row[f'{key}_gpu_ms']:.0f} ms, "
            f"{row[f'{key}_kernels']} kernels{syncs})"
        )

    def peak(key):
        if f"{key}_peak_gib" not in row or row[f"{key}_peak_gib"] != row[f"{key}_peak_gib"]:
            return ""
        reserved = row.get(f"{key}_reserved_gib")
        text = f" peak {row[f'{key}_peak_gib']:.1f} GiB (step +{row[f'{key}_step_gib']:.1f}"
        return text + (f", {reserved:.1f} reserved)" if reserved else ")")

    head = f"[{row['layers']}L] {row['shape']} {row['arm']} (C={row['C']}):"
    lines = [
        (
            f"{head} ckpt {ms('ckpt')}{split('ckpt')}{peak('ckpt')} | eager {ms('eager')}{split('eager')}"
            f"{peak('eager')} | static {ms('static')}{split('static')}"
        ),
        (
            f"    static == model's own step: {'yes' if row['static_equal'] else 'NO'} (max |d grad| "
            f"{row['static_diff']:.3g} {row['static_where']}; eager-vs-eager floor {row['floor']:.3g}); "
            f"host syncs inside the layer stack: {row['stack_syncs']}"
        ),
    ]
    for granularity in GRANULARITIES:
        key = f"graphed_{granularity}"
        if f"{key}_error" in row:
            lines.append(f"    {key}: FAILED {row[f'{key}_error']}")
        elif f"{key}_ms" in row:
            lines.append(
                f"    {key} {ms(key)}{split(key)}{peak(key)}: {row['eager_ms'] / row[f'{key}_ms']:.2f}x over eager, "
                f"{row['static_ms'] / row[f'{key}_ms']:.2f}x over static; equal to eager: "
                f"{'yes' if row[f'{key}_equal'] else 'NO'} (max |d grad| {row[f'{key}_diff']:.3g} "
                f"{row[f'{key}_where']}; floor {row['floor']:.3g}); capture {row[f'{key}_capture_s']:.1f} s"
            )
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape",
        default=None,
        help="one n x P x R shape or control of shared_prefix_gpu (default 4x2048x256; --tiny: "
        "tiny n=4 P=192 R=32)",
    )
    parser.add_argument("--layers", default="8", help="depths, comma-separated (e.g. 8,32)")
    parser.add_argument("--arms", default="packed,shared", help="comma-separated of packed, shared")
    parser.add_argument(
        "--granularity",
        default="stack",
        help="comma-separated: stack (one graph for all layers), layer (one per layer); each is its own capture",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before each timing")
    parser.add_argument(
        "--graph-warmup", type=int, default=3, help="make_graphed_callables' warm-up iterations"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement")
    parser.add_argument(
        "--no-ckpt", dest="ckpt", action="store_false", help="skip the checkpointed reference step"
    )
    parser.add_argument(
        "--no-host-split", dest="host_split", action="store_false", help="skip the host vs GPU split"
    )
    parser.add_argument("--out", default=None, help="write graphed_step_<device>.csv here")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny widths and shape on the CPU, float32 (script test)"
    )
    args = parser.parse_args(argv)
    args.arms = names(args.arms, tuple(ARMS), "--arms")
    args.granularity = names(args.granularity, GRANULARITIES, "--granularity")
    args.layers = depths(args.layers)
    if args.tiny and args.shape is None:
        args.shape = TINY_SHAPES["n4"]
    else:
        shapes = parse_shapes(args.shape or "4x2048x256")
        if len(shapes) != 1:
            raise SystemExit(f"--shape: give one shape, got {len(shapes)} from {args.shape!r}")
        args.shape = shapes[0]
    return args


class Context:
    def __init__(self, args, device, layers):
        self.args, self.device, self.layers, self.shape = args, device, layers, args.shape
        self.timer = Timer(device)
        self.repeats = Repeats(args.repeats, args.repeats)
        self.cost_us = profiler_cost_us(device) if args.host_split and device.type == "cuda" else float("nan")


def write(rows: list[dict], path: Path) -> None:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    # as shared_prefix_gpu.py: CUPTI torn down after each profiled call, so later launches do not pay for it
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    widths = TINY if args.tiny else WIDTHS
    path = None
    if args.out:
        label = "cpu-tiny" if device.type == "cpu" else torch.cuda.get_device_name().replace(" ", "_")
        path = Path(args.out) / f"graphed_step_{label}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
    rows, began = [], time.perf_counter()
    for layers in args.layers:
        ctx = Context(args, device, layers)
        model = uncheckpointed(our_model(widths, layers, device, dtype))
        set_tree(model, args.shape)
        ids, cu, max_len, _ = shape_batch(args.shape, widths["vocab_size"], device)
        for arm in args.arms:
            try:
                row = run_arm(model, arm, (ids, cu, max_len), ctx)
            except Exception as error:  # noqa: BLE001 - an OOM at 32 layers, say: the next arm still runs
                row = {"arm": arm, "layers": layers, "shape": args.shape.name, "error": describe(error)}
                print(f"[{layers}L] {arm}: FAILED before the graph: {row['error']}", flush=True)
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            else:
                print(summary(row), flush=True)
            rows.append(row)
            if path:
                write(rows, path)  # after every arm: a run cut short keeps what it measured
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if path:
        print(f"wrote {path}")
    print(f"done in {time.perf_counter() - began:.0f} s")
    return rows


if __name__ == "__main__":
    main()
