"""What each of our Triton kernels spends, and how close it runs to memory speed (not a test).

Same cases as bench/triton_kernels.py (T = 16384 in 4 sequences, bf16, Qwen3.5-4B/9B widths).

    python bench/triton_profile.py [--ops ...] [--arms ours,fla] [--csv p.csv]
        # torch.profiler (CUPTI) kernel times of one forward + backward, per kernel: calls, ms per step,
        # share; for ours also the bytes the kernel must move (inputs read once, outputs written once,
        # `kernel_bytes`) and the bandwidth that implies against the copy bandwidth measured in the run
    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python bench/triton_profile.py --ncu-target
        # one warmed-up forward + backward per op and arm between cudaProfilerStart/Stop, for Nsight Compute

A kernel near 100% of the copy bandwidth is at the memory floor; one far below it is limited by
something else (its arithmetic, latency, occupancy), which the Nsight Compute sections say.
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch
from triton_kernels import ARMS, BENCH, OPS, Case, _subset, machine_rates, make_step, op_table


def kernel_bytes(case: Case) -> dict[str, int]:
    """Bytes one call of each of our kernels must move at `case`: what it reads and writes, each once.
    Fp32 intermediates count 4 bytes, as our kernels store them; k and q are read once although every
    value head of a key head reads them (the rereads should hit L2)."""
    c, e, f = case, case.nbytes, 4
    qk = c.T * c.H * c.K * e
    vv = c.T * c.HV * c.V * e
    per_head = c.T * c.HV  # g, gc, beta, dg, dbeta: one value a token and value head
    nt = sum(-(-n // 64) for n in (c.lengths or [c.T // c.N] * c.N))
    states = nt * c.HV * c.K * c.V * e
    A = c.T * c.HV * 64 * f
    w_e, wk_f = c.T * c.HV * c.K * e, c.T * c.HV * c.K * f
    du = c.T * c.HV * c.V * f
    conv = c.T * c.conv_d * e
    norm = c.T * c.HV * c.V * e
    return {
        "l2norm_fwd_kernel": 2 * qk + c.T * c.H * f,
        "l2norm_bwd_kernel": qk + c.T * c.H * f + wk_f + qk,  # dy per value head (fp32), summed in the kernel
        "chunk_cumsum_kernel": 2 * per_head * f,
        "wy_fwd_kernel": qk + vv + per_head * (e + f) + A + w_e + vv,
        "chunk_state_fwd_kernel": qk + w_e + vv + per_head * f + states + vv,
        "chunk_output_fwd_kernel": 2 * qk + per_head * f + states + vv + vv,
        "chunk_state_bwd_kernel": 2 * qk + w_e + per_head * f + vv + states + du,
        "chunk_output_bwd_kernel": 2 * qk + per_head * f + 2 * states + vv + vv + du + 3 * wk_f + per_head * f,
        "wy_bwd_kernel": qk + vv + per_head * (e + f) + A + wk_f + du + wk_f + per_head * f  # read
                         + wk_f + vv + 2 * per_head * f,  # written: dk, dv, dbeta, dg
        "causal_conv1d_fwd_kernel": 2 * conv,
        "causal_conv1d_fwd_window_kernel": 2 * conv,
        "causal_conv1d_bwd_kernel": 3 * conv,
        "causal_conv1d_bwd_window_kernel": 3 * conv,
        "causal_conv1d_bwd_recompute_kernel": 3 * conv,
        "rms_norm_gated_fwd_kernel": 3 * norm + c.T * c.HV * f,
        "rms_norm_gated_bwd_kernel": 5 * norm + c.T * c.HV * f,
    }


def short_name(name: str) -> str:
    """A CUDA kernel's name without template arguments and parameter lists (aten's are long)."""
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name.removeprefix("void ").strip()[:70]


def profile_step(step, steps: int) -> dict[str, list]:
    """{kernel: [calls per step, device ms per step]} over `steps` calls of step(), after two warm-ups."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time > 0:
            got = totals.setdefault(short_name(evt.name), [0.0, 0.0])
            got[0] += 1 / steps
            got[1] += evt.device_time / steps / 1e3
    return totals


def run(args, bandwidth: float, case: Case = BENCH) -> list[dict]:
    model = kernel_bytes(case)
    rows = []
    table = op_table(case, tuple(args.arms.split(",")))
    for op in args.ops.split(","):
        make_arms, make, _ = table[op]
        for arm, fn in make_arms().items():
            try:
                totals = profile_step(make_step(fn, make, True), args.steps)
            except Exception as exc:  # noqa: BLE001 - report, go on with the next arm
                print(f"{op} {arm}: failed {exc!r}", file=sys.stderr)
                continue
            total = sum(ms for _, ms in totals.values())
            print(f"\n{op} fwd+bwd, {arm}: {total:.3f} ms of kernels per step "
                  f"(copy bandwidth {bandwidth / 1e12:.2f} TB/s)")
            print(f"  {'kernel':<48}{'calls':>6}{'ms':>9}{'share':>7}{'us/call':>9}{'MB/call':>9}{'TB/s':>7}{'of copy':>8}")
            for name, (calls, ms) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
                nbytes = model.get(name) if arm == "ours" else None
                per_call_ms = ms / calls
                tbs = nbytes / (per_call_ms * 1e-3) / 1e12 if nbytes else float("nan")
                rows.append(dict(op=op, arm=arm, kernel=name, calls=calls, ms=ms, share=ms / total,
                                 us_per_call=per_call_ms * 1e3, mb_per_call=(nbytes or float("nan")) / 1e6,
                                 tb_s=tbs, of_copy=tbs * 1e12 / bandwidth))
                r = rows[-1]
                print(f"  {name[:47]:<48}{calls:>6.0f}{ms:>9.3f}{r['share']:>7.1%}{r['us_per_call']:>9.1f}"
                      f"{r['mb_per_call']:>9.1f}{tbs:>7.2f}{r['of_copy']:>8.1%}")
            torch.cuda.empty_cache()
    return rows


def ncu_target(args, case: Case = BENCH) -> None:
    """Per op and arm: two warm-up steps (compile, autotune), then one step between
    cudaProfilerStart and Stop, so that `ncu --profile-from-start off` sees only that step."""
    table = op_table(case, tuple(args.arms.split(",")))
    for op in args.ops.split(","):
        make_arms, make, _ = table[op]
        for arm, fn in make_arms().items():
            step = make_step(fn, make, True)
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"ncu target: {op} {arm} fwd+bwd", flush=True)
            del step
            torch.cuda.empty_cache()


def write_csv(rows: list[dict], path: str) -> None:
    import triton

    fields = ["op", "arm", "kernel", "calls", "ms", "share", "us_per_call", "mb_per_call", "tb_s", "of_copy"]
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(fields + ["gpu", "triton", "torch"])
        for r in rows:
            out.writerow([r["op"], r["arm"], r["kernel"], f"{r['calls']:.0f}", f"{r['ms']:.4f}", f"{r['share']:.4f}",
                          f"{r['us_per_call']:.2f}", f"{r['mb_per_call']:.2f}", f"{r['tb_s']:.3f}",
                          f"{r['of_copy']:.3f}", torch.cuda.get_device_name(), triton.__version__, torch.__version__])
    print(f"wrote {path}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS), type=lambda v: _subset(v, OPS, "--ops"))
    parser.add_argument("--arms", default="ours,fla", type=lambda v: _subset(v, ARMS, "--arms"))
    parser.add_argument("--steps", type=int, default=5, help="profiled forward + backward steps per op and arm")
    parser.add_argument("--csv", help="where to write the per-kernel rows")
    parser.add_argument("--ncu-target", action="store_true",
                        help="run one step per op and arm between cudaProfilerStart/Stop, for ncu")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/triton_profile.py needs a CUDA device")
    if args.ncu_target:
        return ncu_target(args)
    bandwidth, _ = machine_rates(20)
    rows = run(args, bandwidth)
    if args.csv:
        write_csv(rows, args.csv)


if __name__ == "__main__":
    main()
