"""The launch presets of our conv and gated-norm kernels, timed and checked (bench/triton_tuning.py --sweep).

Per preset and pass (fwd, bwd alone, fwd+bwd through autograd as a model runs it):
- gpu ms: median between two CUDA events around one call, as bench/triton_kernels.py measures; it
  includes any time the GPU waits for the host to issue the launches;
- graph ms: the same call replayed from a CUDA graph, i.e. the kernels alone, without host work;
- host us: median Python time to issue one call (launches queued, not waited for);
- x floor: gpu ms and graph ms over the bytes that must move at the measured copy bandwidth.
Before timing, each preset's outputs and gradients are checked against a float64 reference on a
varlen case at the same widths (a miscompiled preset prints WRONG and is not timed).
"""

from __future__ import annotations

import math
import sys
import time

import torch
from triton_kernels import BYTES, CONV_D, CONV_W, DT, HV, T, V, conv_inputs, host_ms, norm_inputs, timed

LENGTHS = [300, 37, 687]  # the GPU tests' varlen case: one sequence shorter than a step of rows
BOUND = 8e-3  # bf16: one rounding of each output, relative to the largest reference value
DEVICE = "cuda"


def host_us(fn, calls: int = 40) -> float:
    """Median microseconds to issue one fn() (`triton_kernels.host_ms`: the queue drained before every batch of 5)."""
    return host_ms(fn, calls) * 1e3


def graph_ms(fn, repeats: int) -> float:
    """Median ms of fn() replayed from a CUDA graph (the kernels alone); nan when it cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return timed(graph.replay, repeats)
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"    (no CUDA graph: {exc!r})", file=sys.stderr)
        torch.cuda.synchronize()
        return float("nan")


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _measure(rows, kernel, preset, pass_, fn, floor_ms, repeats):
    ms, gms, hus = timed(fn, repeats), graph_ms(fn, repeats), host_us(fn)
    rows.append(dict(kernel=kernel, preset=preset, pass_=pass_, gpu_ms=ms, graph_ms=gms, host_us=hus,
                     floor_ms=floor_ms, x_floor=ms / floor_ms, graph_x_floor=gms / floor_ms))
    print(f"  {kernel} {preset:<16} {pass_:<8} gpu {ms:7.3f} ms  graph {gms:7.3f} ms  host {hus:6.1f} us  "
          f"x floor {ms / floor_ms:5.2f} (graph {gms / floor_ms:5.2f})", flush=True)


def conv_errors(mod, tuning) -> dict:
    """Errors of one preset against float64 on the varlen case (bf16 inputs, 4B/9B conv widths)."""
    from patchgen.kernels.triton.causal_conv1d import causal_conv1d_reference

    torch.manual_seed(1)
    n = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    # no bias, as in Qwen3.5 and the timed runs (one compile per preset; the CPU tests cover the bias)
    x, w, dy = (torch.randn(*s, device=DEVICE).to(DT) for s in ((n, CONV_D), (CONV_D, CONV_W), (n, CONV_D)))
    ref = [t.double().requires_grad_() for t in (x, w)]
    y_ref = causal_conv1d_reference(ref[0][None], ref[1], cu_seqlens=cu.cpu())[0]
    want = torch.autograd.grad(y_ref, ref, dy.double())
    y = mod.conv_fwd(x, w, None, cu, True, tuning)
    got = mod.conv_bwd(x, w, None, dy, cu, True, tuning)[:2]
    return {name: rel_err(a, r) for name, a, r in zip(("y", "dx", "dw"), (y, *got), (y_ref, *want))}


def norm_errors(mod, tuning) -> dict:
    from patchgen.kernels.triton.rms_norm_gated import rms_norm_gated_reference

    torch.manual_seed(1)
    n = sum(LENGTHS) * HV
    x, gate, dy = (torch.randn(n, V, device=DEVICE).to(DT) for _ in range(3))
    w = torch.randn(V, device=DEVICE).to(DT)
    ref = [t.double().requires_grad_() for t in (x, gate, w)]
    y_ref = rms_norm_gated_reference(*ref, 1e-6)
    want = torch.autograd.grad(y_ref, ref, dy.double())
    y, rstd = mod.norm_fwd(x, gate, w, 1e-6, tuning)
    got = mod.norm_bwd(x, gate, w, rstd, dy, tuning)
    return {name: rel_err(a, r) for name, a, r in zip(("y", "dx", "dgate", "dw"), (y, *got), (y_ref, *want))}


def _checked(kernel, name, errors_of) -> bool:
    try:
        errors = errors_of()
    except Exception as exc:  # noqa: BLE001 - e.g. out of registers or shared memory
        print(f"  {kernel} {name:<16} FAILED {exc!r}", flush=True)
        return False
    ok = all(err < BOUND for err in errors.values())
    print(f"  {kernel} {name:<16} {'ok   ' if ok else 'WRONG'} vs float64: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    return ok


def _compile_one(kind: str, name: str) -> str:
    """Run one preset's float64 check in this (worker) process: compiles its kernels into Triton's
    on-disk cache, where the sweep's own process then finds them."""
    import importlib

    mod = importlib.import_module(f"patchgen.kernels.triton.{'causal_conv1d' if kind == 'conv' else 'rms_norm_gated'}")
    try:
        (conv_errors if kind == "conv" else norm_errors)(mod, mod.PRESETS[name])
        return f"{kind} {name}"
    except Exception as exc:  # noqa: BLE001 - the sweep reports it again in order
        return f"{kind} {name}: {type(exc).__name__}"


def precompile(args) -> None:
    """Compile every preset's kernels in args.jobs processes at once (compiling is CPU-bound and
    takes most of a cold sweep's time; the timing itself stays in one process)."""
    import concurrent.futures
    import importlib
    import multiprocessing

    if args.jobs < 2:
        return
    wanted = []
    for kind, module in (("norm", "rms_norm_gated"), ("conv", "causal_conv1d")):
        if kind in args.only.split(","):
            presets = importlib.import_module(f"patchgen.kernels.triton.{module}").PRESETS
            wanted += [(kind, n) for n in presets if not args.presets or n in args.presets.split(",")]
    t0 = time.perf_counter()
    try:
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(_compile_one, *zip(*wanted)))
        print(f"compiled {len(done)} presets in {args.jobs} processes in {time.perf_counter() - t0:.0f} s: "
              + "; ".join(d for d in done if ":" in d), flush=True)
    except Exception as exc:  # noqa: BLE001 - then the sweep compiles as it goes
        print(f"parallel compile skipped: {exc!r}", flush=True)


MARGIN = 0.03  # a preset replaces the device's current default only when faster by more than this


def current_preset(mod) -> str | None:
    """The name of the preset a call on this GPU gets today (the tuning table's, or the code's default)."""
    current = mod.default_tuning(torch.device(DEVICE))
    return next((name for name, t in mod.PRESETS.items() if t == current), None)


def pick(times: dict[str, float], current: str | None, margin: float = MARGIN) -> str | None:
    """The fastest preset by forward + backward ms, unless the current one is within `margin` of it
    (run-to-run noise must not flip the defaults); None when nothing was timed."""
    timed_ok = {name: ms for name, ms in times.items() if not math.isnan(ms)}  # NaN: failed
    if not timed_ok:
        return None
    best = min(timed_ok, key=timed_ok.get)
    if current in timed_ok and timed_ok[best] > timed_ok[current] * (1 - margin):
        return current
    return best


def _sweep(kind, mod, args, rows, floor, errors, fwd, bwd, autograd_step) -> str | None:
    """Check then time every preset of `mod` (args.presets filters by name): the forward and backward
    functions with the preset passed, then forward + backward through autograd, which reads the
    module's configuration. Returns the preset to make the default (`pick`)."""
    override = mod.TUNING
    current = current_preset(mod)
    times = {}
    for name, tuning in mod.PRESETS.items():
        if args.presets and name not in args.presets.split(","):
            continue
        if not _checked(kind, name, lambda t=tuning: errors(mod, t)):
            continue
        _measure(rows, kind, name, "fwd", lambda t=tuning: fwd(t), floor["fwd"], args.repeats)
        _measure(rows, kind, name, "bwd", lambda t=tuning: bwd(t), floor["bwd"], args.repeats)
        mod.TUNING = tuning
        try:
            _measure(rows, kind, name, "fwd+bwd", autograd_step, floor["fwd+bwd"], args.repeats)
        finally:
            mod.TUNING = override
        times[name] = rows[-1]["gpu_ms"]
        torch.cuda.empty_cache()
    best = pick(times, current)
    if best is not None:
        print(f"{kind}: current default {current} ({times.get(current, float('nan')):.3f} ms fwd+bwd), fastest "
              f"{min(times, key=times.get)} ({min(times.values()):.3f} ms); the default becomes {best} "
              f"(a change needs more than {MARGIN:.0%})", flush=True)
    return best


def sweep_conv(args, bandwidth, rows) -> str | None:
    """Time every conv preset; returns the fastest forward + backward's name."""
    import importlib

    mod = importlib.import_module("patchgen.kernels.triton.causal_conv1d")
    floor = {p: n * T * CONV_D * BYTES / bandwidth * 1e3 for p, n in (("fwd", 2), ("bwd", 3), ("fwd+bwd", 5))}
    print("\nconv presets; floors (ms): " + ", ".join(f"{p} {v:.3f}" for p, v in floor.items()), flush=True)
    (x, w), (cu,) = conv_inputs(False)
    x = x[0]
    dy = torch.randn_like(x)
    (xg, wg), (cug,) = conv_inputs(True)
    dyg = torch.randn_like(xg)

    def step():
        y = mod.causal_conv1d(xg, wg, cu_seqlens=cug)
        torch.autograd.grad(y, (xg, wg), dyg)

    return _sweep("conv", mod, args, rows, floor, conv_errors,
                  lambda t: mod.conv_fwd(x, w, None, cu, True, t),
                  lambda t: mod.conv_bwd(x, w, None, dy, cu, True, t), step)


def sweep_norm(args, bandwidth, rows) -> str | None:
    """Time every gated-norm preset; returns the fastest forward + backward's name."""
    import importlib

    mod = importlib.import_module("patchgen.kernels.triton.rms_norm_gated")
    n = T * HV * V
    floor = {p: k * n * BYTES / bandwidth * 1e3 for p, k in (("fwd", 3), ("bwd", 5), ("fwd+bwd", 8))}
    print("\ngated-norm presets; floors (ms): " + ", ".join(f"{p} {v:.3f}" for p, v in floor.items()), flush=True)
    (x, gate, w), _ = norm_inputs(False)
    dy = torch.randn_like(x)
    _, rstd = mod.norm_fwd(x, gate, w, 1e-6)
    (xg, gg, wg), _ = norm_inputs(True)
    dyg = torch.randn_like(xg)

    def step():
        y = mod.rms_norm_gated(xg, gg, wg, 1e-6)
        torch.autograd.grad(y, (xg, gg, wg), dyg)

    return _sweep("norm", mod, args, rows, floor, norm_errors,
                  lambda t: mod.norm_fwd(x, gate, w, 1e-6, t),
                  lambda t: mod.norm_bwd(x, gate, w, rstd, dy, t), step)


def launch_costs(rows):
    """Host microseconds of the pieces of one call, to see where a call's host time goes."""
    import importlib

    import triton

    conv = importlib.import_module("patchgen.kernels.triton.causal_conv1d")
    (x, w), (cu,) = conv_inputs(False)
    x = x[0]
    y = torch.empty_like(x)
    kernel, grid, meta, n_iter = conv._fwd_launch(T, CONV_D, CONV_W, 4, x.dtype, x.device, False, True,
                                                  conv.default_tuning(x.device))
    pieces = {
        "torch.empty_like (one output)": lambda: torch.empty_like(x),
        "one Triton launch (conv fwd, shapes cached)": lambda: kernel[grid](x, w, None, y, cu, n_iter, 4, T, **meta),
        "conv_fwd (allocation + launch)": lambda: conv.conv_fwd(x, w, None, cu, True),
        "x.sum(0) (one torch reduction)": lambda: x.sum(0),
    }
    print(f"\nhost cost of the pieces of a call (Triton {triton.__version__})", flush=True)
    for what, fn in pieces.items():
        fn()
        us = host_us(fn)
        rows.append(dict(kernel="host", preset=what, pass_="", gpu_ms=float("nan"), graph_ms=float("nan"), host_us=us,
                         floor_ms=float("nan"), x_floor=float("nan"), graph_x_floor=float("nan")))
        print(f"  {what:<45} {us:6.1f} us", flush=True)


def write_csv(rows, path):
    import csv

    import triton

    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["kernel", "preset", "pass", "gpu_ms", "graph_ms", "host_us", "floor_ms", "x_floor",
                      "graph_x_floor", "gpu", "triton", "torch"])
        for r in rows:
            out.writerow([r["kernel"], r["preset"], r["pass_"], f"{r['gpu_ms']:.4f}", f"{r['graph_ms']:.4f}",
                          f"{r['host_us']:.1f}", f"{r['floor_ms']:.4f}", f"{r['x_floor']:.3f}",
                          f"{r['graph_x_floor']:.3f}", torch.cuda.get_device_name(), triton.__version__,
                          torch.__version__])
    print(f"wrote {path}")
