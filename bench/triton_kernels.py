"""Benchmark of our portable Triton kernels on a CUDA GPU (not a timed test).

At T = 16384 in 4 sequences, bf16, Qwen3.5-4B/9B widths (GDN: 16 key heads, 32 value heads, head
dims 128; conv: D = 8192, W = 4; gated RMSNorm: rows of 128), three arms: ours
(patchgen.kernels.triton), fla (the project's fla backend, skipped when missing) and the torch
reference. The GDN is also run with an initial state per sequence and its gradient (the
shared-prefix round-2 case). Chunk tables are built once, as the plan does, and passed to both
GDN arms.

Per arm and pass: GPU time (median over repeats between CUDA events; it includes any time the GPU
waits for the host to issue the launches), graph time (the same call replayed from a CUDA graph:
the kernels alone; conv and gated norm, ours and fla), host time per call (the Python wall time to
issue the call with the GPU not the bottleneck), and the floor (the larger of the bytes that must
move over the measured copy bandwidth and the FLOPs over the measured bf16 matmul rate).

    python bench/triton_kernels.py [--csv bench/results/triton_kernels.csv] [--repeats 50] [--tuning t.json]

Launch-shape sweeps, the GDN profile and the Nsight Compute targets are in bench/triton_tuning.py.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

T, N, H, HV, K, V = 16384, 4, 16, 32, 128, 128
CONV_D, CONV_W = 2 * H * K + HV * V, 4
DT = torch.bfloat16
BYTES = 2  # bf16


def timed(fn, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over `repeats` runs, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, calls: int = 20) -> float:
    """Median host milliseconds to issue one fn() (no synchronisation inside, the GPU queue drained
    before each batch of 5 so that a full launch queue never blocks the host)."""
    per_call = []
    for _ in range(calls // 5):
        torch.cuda.synchronize()
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            per_call.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(per_call)


def machine_rates(repeats: int) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s)."""
    src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), repeats)
    bandwidth = 2 * src.numel() / (ms * 1e-3)
    a = torch.randn(8192, 8192, dtype=DT, device="cuda")
    ms = timed(lambda: a @ a, repeats)
    return bandwidth, 2 * 8192 ** 3 / (ms * 1e-3)


def gdn_cost(backward: bool) -> tuple[float, float]:
    """(bytes, FLOPs) of the chunked algorithm at chunk 64: the inputs read and outputs written once,
    and the matrix products of the WY form, the state recurrence and the outputs (per chunk and
    value head: K K^T, w, u, w h, k^T v, Q K^T, Q h, P U). The backward is counted as twice the forward's
    products plus reading do and writing the input gradients."""
    C = 64
    io = T * (2 * H * K + HV * V + 2 * HV) * BYTES + T * HV * V * BYTES
    per_chunk = 2 * C * C * K * 2 + 2 * C * C * V * 2 + 2 * C * K * V * 3
    flops = (T // C) * HV * per_chunk
    if backward:
        return 2 * io + T * HV * V * BYTES, 3 * flops
    return io, flops


def gdn_tables():
    """cu_seqlens on the device and the host, and the chunk table: built once, as the plan does."""
    from patchgen.kernels.shared_prefix.gdn import chunk_indices

    cu_cpu = torch.arange(0, T + 1, T // N, dtype=torch.int32)
    chunks = torch.from_numpy(chunk_indices(cu_cpu.diff().tolist()).astype("int32")).cuda()
    return cu_cpu.cuda(), cu_cpu, chunks


def gdn_inputs(backward: bool, with_state: bool = False):
    torch.manual_seed(0)
    q = torch.randn(1, T, H, K, dtype=DT, device="cuda")
    k = torch.randn(1, T, H, K, dtype=DT, device="cuda")
    v = torch.randn(1, T, HV, V, dtype=DT, device="cuda")
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, device="cuda"))
    beta = torch.rand(1, T, HV, dtype=DT, device="cuda")
    ins = [q, k, v, g, beta]
    if with_state:
        ins.append(torch.randn(N, HV, K, V, device="cuda") * 0.1)
    return [t.requires_grad_(backward) for t in ins], list(gdn_tables())


def gdn_arms(with_state: bool):
    from patchgen.kernels.triton import gated_delta_rule

    def call(impl):
        def run(q, k, v, g, beta, *rest):
            h0 = rest[0] if with_state else None
            cu, cu_cpu, chunks = rest[-3:]
            return impl(q, k, v, g, beta, initial_state=h0, output_final_state=with_state,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=chunks)
        return run

    arms = {"ours": call(gated_delta_rule)}
    try:
        from patchgen.kernels.backends import fla

        arms["fla"] = call(fla.gated_delta_rule)
    except Exception as exc:  # noqa: BLE001 - any import failure skips the arm
        print(f"fla GDN arm skipped: {exc!r}", file=sys.stderr)
    from patchgen.kernels.reference import gated_delta_rule as reference

    def torch_arm(q, k, v, g, beta, *rest):  # fp32 throughout: the reference takes one dtype
        h0 = rest[0] if with_state else None
        cu, cu_cpu, _ = rest[-3:]
        return reference.gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0,
                                          output_final_state=with_state, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    arms["torch"] = torch_arm
    return arms


def conv_inputs(backward: bool):
    torch.manual_seed(0)
    x = torch.randn(1, T, CONV_D, dtype=DT, device="cuda", requires_grad=backward)
    w = torch.randn(CONV_D, CONV_W, dtype=DT, device="cuda", requires_grad=backward)
    return [x, w], [torch.arange(0, T + 1, T // N, dtype=torch.int32, device="cuda")]


def conv_arms():
    from patchgen.kernels.reference import causal_conv1d as reference
    from patchgen.kernels.triton import causal_conv1d
    arms = {"ours": lambda x, w, cu: causal_conv1d(x, w, cu_seqlens=cu)}
    try:
        from patchgen.kernels.backends import fla

        arms["fla"] = lambda x, w, cu: fla.causal_conv1d(x, w, cu_seqlens=cu)
    except Exception as exc:  # noqa: BLE001
        print(f"fla conv arm skipped: {exc!r}", file=sys.stderr)
    arms["torch"] = lambda x, w, cu: reference.causal_conv1d(x, w, cu_seqlens=cu)
    return arms


def norm_inputs(backward: bool):
    torch.manual_seed(0)
    x = torch.randn(T * HV, V, dtype=DT, device="cuda", requires_grad=backward)
    gate = torch.randn(T * HV, V, dtype=DT, device="cuda", requires_grad=backward)
    w = torch.randn(V, dtype=DT, device="cuda", requires_grad=backward)
    return [x, gate, w], []


def norm_arms():
    from patchgen.kernels.reference import norms
    from patchgen.kernels.triton import rms_norm_gated
    arms = {"ours": lambda x, gate, w: rms_norm_gated(x, gate, w, 1e-6)}
    try:
        from patchgen.kernels.backends import fla

        arms["fla"] = lambda x, gate, w: fla.rms_norm_gated(x, gate, w, 1e-6)  # the weight passed, not a module's
    except Exception as exc:  # noqa: BLE001
        print(f"fla gated-norm arm skipped: {exc!r}", file=sys.stderr)
    arms["torch"] = lambda x, gate, w: norms.rms_norm_gated(x, gate, w, 1e-6)
    return arms


def make_step(fn, make_inputs, backward: bool):
    """fn's call (and its backward, through autograd.grad so that nothing accumulates) as one step,
    with a random output gradient for every floating output."""
    ins, extra = make_inputs(backward)
    leaves = [t for t in ins if t.requires_grad]
    out = fn(*ins, *extra)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    grads_out = [torch.randn_like(o) for o in outs] if backward else None

    def step():
        out = fn(*ins, *extra)
        if backward:
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
            torch.autograd.grad(outs, leaves, grads_out)
    return step


def run_bench(args, bandwidth, matmul):
    conv_bytes = {False: 2 * T * CONV_D * BYTES, True: 5 * T * CONV_D * BYTES}  # fwd: x, y; +bwd: dy, x, dx
    norm_bytes = {False: 3 * T * HV * V * BYTES, True: 8 * T * HV * V * BYTES}  # fwd: x, gate, y; +bwd: x, gate, dy, dx, dgate
    ops = {
        "gated_delta_rule": (lambda: gdn_arms(False), lambda b: gdn_inputs(b), gdn_cost),
        "gated_delta_rule_h0": (lambda: gdn_arms(True), lambda b: gdn_inputs(b, with_state=True), gdn_cost),
        "causal_conv1d": (conv_arms, conv_inputs, lambda b: (conv_bytes[b], 0.0)),
        "rms_norm_gated": (norm_arms, norm_inputs, lambda b: (norm_bytes[b], 0.0)),
    }
    rows = []
    for op in args.ops.split(","):
        make_arms, make, cost = ops[op]
        arms = make_arms()
        for backward in (False, True):
            nbytes, flops = cost(backward)
            floor_ms = max(nbytes / bandwidth, flops / matmul) * 1e3
            for arm, fn in arms.items():
                if arm not in args.arms.split(","):
                    continue
                is_torch = arm == "torch"
                gms = float("nan")
                try:
                    step = make_step(fn, make, backward)
                    ms = timed(step, args.torch_repeats if is_torch else args.repeats, warmup=1 if is_torch else 3)
                    host = float("nan") if is_torch else host_ms(step)  # the reference's host time says nothing
                    if not is_torch and op in ("causal_conv1d", "rms_norm_gated"):  # no host syncs to break a capture
                        from triton_presets import graph_ms

                        gms = graph_ms(step, args.repeats)
                except Exception as exc:  # noqa: BLE001 - e.g. fla's GDN backward on Triton < 3.7.1
                    print(f"{op} {arm} {'fwd+bwd' if backward else 'fwd'} failed: {exc!r}", file=sys.stderr)
                    ms = host = float("nan")
                rows.append({"op": op, "pass_": "fwd+bwd" if backward else "fwd", "arm": arm, "ms": ms,
                             "graph_ms": gms, "host_ms": host, "floor_ms": floor_ms, "x_floor": ms / floor_ms})
                print(f"{op} {rows[-1]['pass_']} {arm}: gpu {ms:.3f} ms, graph {gms:.3f} ms, host {host:.3f} ms",
                      flush=True)
                torch.cuda.empty_cache()
    return rows


def report(rows, path):
    by = {(r["op"], r["pass_"], r["arm"]): r["ms"] for r in rows}
    print(f"\n{'op':<21}{'pass':<9}{'arm':<7}{'gpu ms':>9}{'graph ms':>9}{'host ms':>9}{'floor ms':>10}"
          f"{'x floor':>9}{'graph x':>9}{'x fla':>8}")
    for r in rows:
        fla_ms = by.get((r["op"], r["pass_"], "fla"), float("nan"))
        print(f"{r['op']:<21}{r['pass_']:<9}{r['arm']:<7}{r['ms']:>9.3f}{r['graph_ms']:>9.3f}{r['host_ms']:>9.3f}"
              f"{r['floor_ms']:>10.3f}{r['x_floor']:>9.2f}{r['graph_ms'] / r['floor_ms']:>9.2f}{r['ms'] / fla_ms:>8.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    import triton
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["op", "pass", "arm", "ms", "graph_ms", "host_ms", "floor_ms", "x_floor", "graph_x_floor",
                         "gpu", "triton", "torch"])
        for r in rows:
            writer.writerow([r["op"], r["pass_"], r["arm"], f"{r['ms']:.4f}", f"{r['graph_ms']:.4f}",
                             f"{r['host_ms']:.4f}", f"{r['floor_ms']:.4f}", f"{r['x_floor']:.3f}",
                             f"{r['graph_ms'] / r['floor_ms']:.3f}", torch.cuda.get_device_name(),
                             triton.__version__, torch.__version__])
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "results", "triton_kernels.csv"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--torch-repeats", type=int, default=3)
    parser.add_argument("--ops", default="causal_conv1d,rms_norm_gated,gated_delta_rule,gated_delta_rule_h0",
                        help="comma-separated subset of the ops to run (cheapest first)")
    parser.add_argument("--arms", default="ours,fla,torch",
                        help="comma-separated subset of the arms (the torch GDN takes seconds a call at this size)")
    parser.add_argument("--tuning", help="JSON of launch configurations written by bench/triton_tuning.py --sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/triton_kernels.py needs a CUDA device")
    if args.tuning:
        from triton_tuning import apply_tuning

        apply_tuning(args.tuning)
    bandwidth, matmul = machine_rates(args.repeats)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s")
    report(run_bench(args, bandwidth, matmul), args.csv)

if __name__ == "__main__":
    main()
