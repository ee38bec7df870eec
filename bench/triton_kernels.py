"""Benchmark of our portable Triton kernels on a CUDA GPU (not a timed test).

GDN forward and forward+backward at T = 16384 in 4 sequences with Qwen3.5-4B widths
(16 key heads, 32 value heads, head dims 128, bf16), the causal conv1d (D = 8192, W = 4) and
the gated RMSNorm (rows of 128), for three arms: ours (patchgen.kernels.triton), fla
(flash-linear-attention, imported lazily; the arm is skipped when missing or failing) and the
torch reference. Median of many repeats timed with CUDA events; the floor is the larger of bytes
moved over the measured copy bandwidth and FLOPs over the measured bf16 matmul rate.

    python bench/triton_kernels.py [--csv bench/results/triton_kernels.csv] [--repeats 50]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

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


def machine_rates(repeats: int) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
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


def make_gdn_inputs(requires_grad: bool):
    torch.manual_seed(0)
    cu = torch.arange(0, T + 1, T // N, dtype=torch.int32, device="cuda")
    q = torch.randn(1, T, H, K, dtype=DT, device="cuda")
    k = torch.randn(1, T, H, K, dtype=DT, device="cuda")
    v = torch.randn(1, T, HV, V, dtype=DT, device="cuda")
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, device="cuda"))
    beta = torch.rand(1, T, HV, dtype=DT, device="cuda")
    ins = [t.requires_grad_(requires_grad) for t in (q, k, v, g, beta)]
    return ins, cu


def gdn_arms():
    arms = {}
    from patchgen.kernels.triton import gated_delta_rule

    def ours(q, k, v, g, beta, cu):
        return gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                cu_seqlens_cpu=cu.cpu())[0]
    arms["ours"] = ours
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        def fla(q, k, v, g, beta, cu):
            return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]
        arms["fla"] = fla
    except Exception as exc:  # noqa: BLE001 - any import failure skips the arm
        print(f"fla GDN arm skipped: {exc!r}", file=sys.stderr)
    from patchgen.kernels.triton.gated_delta_rule.reference import chunked_gdn_ref

    def reference(q, k, v, g, beta, cu):
        # fp32 throughout: the reference does not mix bf16 inputs with the fp32 gates
        return chunked_gdn_ref(*(x[0].float() for x in (q, k, v, g, beta)), scale=K ** -0.5, use_qk_l2norm=True,
                               cu_seqlens=cu.cpu())[0]
    arms["torch"] = reference
    return arms


def conv_arms():
    from patchgen.kernels.triton import causal_conv1d
    from patchgen.kernels.triton.causal_conv1d import causal_conv1d_reference
    arms = {"ours": lambda x, w, cu: causal_conv1d(x, w, cu_seqlens=cu)}
    try:
        from fla.modules.convolution import causal_conv1d as fla_conv

        arms["fla"] = lambda x, w, cu: fla_conv(x, w, activation="silu", cu_seqlens=cu)[0]
    except Exception as exc:  # noqa: BLE001
        print(f"fla conv arm skipped: {exc!r}", file=sys.stderr)
    arms["torch"] = lambda x, w, cu: causal_conv1d_reference(x, w, cu_seqlens=cu.cpu())
    return arms


def norm_arms():
    from patchgen.kernels.triton import rms_norm_gated
    from patchgen.kernels.triton.rms_norm_gated import rms_norm_gated_reference
    arms = {"ours": lambda x, gate, w: rms_norm_gated(x, gate, w, 1e-6)}
    try:
        from fla.modules import FusedRMSNormGated

        module = FusedRMSNormGated(V, eps=1e-6).to(device="cuda", dtype=DT)

        def fla(x, gate, w):  # the module's weight replaced by w, so that w gets its gradient too
            return torch.func.functional_call(module, {"weight": w}, (x, gate))
        arms["fla"] = fla
    except Exception as exc:  # noqa: BLE001
        print(f"fla gated-norm arm skipped: {exc!r}", file=sys.stderr)
    arms["torch"] = lambda x, gate, w: rms_norm_gated_reference(x, gate, w, 1e-6)
    return arms


def bench_arm(fn, make_inputs, backward: bool, repeats: int, warmup: int = 3):
    ins, extra = make_inputs(backward)
    leaves = [t for t in ins if t.requires_grad]
    grad_out = torch.ones_like(fn(*ins, *extra)) if backward else None

    def step():
        out = fn(*ins, *extra)
        if backward:  # autograd.grad: nothing accumulates into .grad between repeats
            torch.autograd.grad(out, leaves, grad_out)
    return timed(step, repeats, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "results", "triton_kernels.csv"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--torch-repeats", type=int, default=3)
    parser.add_argument("--ops", default="gated_delta_rule,causal_conv1d,rms_norm_gated",
                        help="comma-separated subset of the ops to run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/triton_kernels.py needs a CUDA device")

    bandwidth, matmul = machine_rates(args.repeats)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s")

    def conv_inputs(backward):
        torch.manual_seed(0)
        x = torch.randn(1, T, CONV_D, dtype=DT, device="cuda", requires_grad=backward)
        w = torch.randn(CONV_D, CONV_W, dtype=DT, device="cuda", requires_grad=backward)
        return [x, w], [torch.arange(0, T + 1, T // N, dtype=torch.int32, device="cuda")]

    def norm_inputs(backward):
        torch.manual_seed(0)
        x = torch.randn(T * HV, V, dtype=DT, device="cuda", requires_grad=backward)
        gate = torch.randn(T * HV, V, dtype=DT, device="cuda", requires_grad=backward)
        w = torch.randn(V, dtype=DT, device="cuda", requires_grad=backward)
        return [x, gate, w], []

    def gdn_inputs(backward):
        ins, cu = make_gdn_inputs(backward)
        return ins, [cu]

    conv_bytes = {False: 2 * T * CONV_D * BYTES, True: 5 * T * CONV_D * BYTES}  # fwd: x, y; +bwd: dy, x, dx
    norm_bytes = {False: 3 * T * HV * V * BYTES, True: 8 * T * HV * V * BYTES}
    rows = []
    ops = {
        "gated_delta_rule": (gdn_arms, gdn_inputs, gdn_cost),
        "causal_conv1d": (conv_arms, conv_inputs, lambda b: (conv_bytes[b], 0.0)),
        "rms_norm_gated": (norm_arms, norm_inputs, lambda b: (norm_bytes[b], 0.0)),
    }
    for op in args.ops.split(","):
        make_arms, make, cost = ops[op]
        arms = make_arms()
        for backward in (False, True):
            nbytes, flops = cost(backward)
            floor_ms = max(nbytes / bandwidth, flops / matmul) * 1e3
            for arm, fn in arms.items():
                repeats = args.torch_repeats if arm == "torch" else args.repeats
                try:
                    ms = bench_arm(fn, make, backward, repeats, warmup=1 if arm == "torch" else 3)
                except Exception as exc:  # noqa: BLE001 - e.g. fla's GDN backward on Triton < 3.7.1
                    print(f"{op} {arm} {'fwd+bwd' if backward else 'fwd'} failed: {exc!r}", file=sys.stderr)
                    ms = float("nan")
                rows.append({"op": op, "pass_": "fwd+bwd" if backward else "fwd", "arm": arm, "ms": ms, "floor_ms": floor_ms,
                                 "x_floor": ms / floor_ms})
                torch.cuda.empty_cache()

    by = {(r["op"], r["pass_"], r["arm"]): r["ms"] for r in rows}
    print(f"\n{'op':<18}{'pass':<9}{'arm':<7}{'ms':>10}{'floor ms':>10}{'x floor':>9}{'x fla':>8}")
    for r in rows:
        fla_ms = by.get((r["op"], r["pass_"], "fla"), float("nan"))
        print(f"{r['op']:<18}{r['pass_']:<9}{r['arm']:<7}{r['ms']:>10.3f}{r['floor_ms']:>10.3f}"
              f"{r['x_floor']:>9.2f}{r['ms'] / fla_ms:>8.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["op", "pass", "arm", "ms", "floor_ms", "x_floor", "gpu", "triton", "torch"])
        import triton
        for r in rows:
            writer.writerow([r["op"], r["pass_"], r["arm"], f"{r['ms']:.4f}", f"{r['floor_ms']:.4f}",
                             f"{r['x_floor']:.3f}", torch.cuda.get_device_name(), triton.__version__,
                             torch.__version__])
    print(f"\nwrote {args.csv}")


if __name__ == "__main__":
    main()
