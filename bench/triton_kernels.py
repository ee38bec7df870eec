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
    python bench/triton_kernels.py --tiny --csv t.csv   # CPU, Triton's interpreter, tiny widths: checks the script

Launch-shape sweeps, the GDN profile and the Nsight Compute targets are in bench/triton_tuning.py and
bench/triton_profile.py; bench/triton_floor_run.sh runs all of it in one device call.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    """The widths and dtype a run measures at (GDN heads, conv width, gated-norm rows)."""

    T: int = 16384
    N: int = 4
    H: int = 16
    HV: int = 32
    K: int = 128
    V: int = 128
    W: int = 4
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    lengths: tuple[int, ...] | None = None  # of the N sequences; None: T // N each

    def __post_init__(self):
        if self.lengths is not None and (len(self.lengths) != self.N or sum(self.lengths) != self.T):
            raise ValueError(f"lengths {self.lengths} must be N={self.N} sequences summing to T={self.T}")

    @property
    def conv_d(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def nbytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        return (f"T={self.T} N={self.N} H={self.H} HV={self.HV} K={self.K} V={self.V} W={self.W} "
                f"{str(self.dtype).removeprefix('torch.')}")


BENCH = Case()
# The CPU check of this script (tests/bench, `--tiny`): Triton's interpreter, fp32 (its tl.dot
# mishandles bf16), a last sequence that ends inside a chunk.
TINY = Case(T=160, N=2, H=2, HV=4, K=16, V=16, W=4, dtype=torch.float32, device="cpu", lengths=(117, 43))

# The bench case's widths under their old names (bench/triton_presets.py, bench/triton_tuning.py).
T, N, H, HV, K, V = BENCH.T, BENCH.N, BENCH.H, BENCH.HV, BENCH.K, BENCH.V
CONV_D, CONV_W = BENCH.conv_d, BENCH.W
DT = BENCH.dtype
BYTES = BENCH.nbytes

OPS = ("causal_conv1d", "rms_norm_gated", "gated_delta_rule", "gated_delta_rule_h0")
ARMS = ("ours", "fla", "torch")


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def timed(fn, repeats: int, warmup: int = 3, device: str = "cuda") -> float:
    """Median milliseconds of fn() over `repeats` runs, each between two CUDA events (CPU: the wall clock)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device == "cpu":
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, calls: int = 20, device: str = "cuda") -> float:
    """Median host milliseconds to issue one fn() (no synchronisation inside, the GPU queue drained
    before each batch of 5 so that a full launch queue never blocks the host)."""
    per_call = []
    for i in range(max(1, calls)):
        if i % 5 == 0:
            _sync(device)
        t0 = time.perf_counter()
        fn()
        per_call.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(per_call)


def machine_rates(repeats: int, case: Case = BENCH) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, matmul FLOP/s in the case's dtype)."""
    n, m = (1 << 30, 8192) if case.device != "cpu" else (1 << 22, 256)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=case.device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), repeats, device=case.device)
    bandwidth = 2 * src.numel() / (ms * 1e-3)
    a = torch.randn(m, m, dtype=case.dtype, device=case.device)
    ms = timed(lambda: a @ a, repeats, device=case.device)
    return bandwidth, 2 * m ** 3 / (ms * 1e-3)


def gdn_cost(backward: bool, case: Case = BENCH) -> tuple[float, float]:
    """(bytes, FLOPs) of the chunked algorithm at chunk 64: the inputs read and outputs written once,
    and the matrix products of the WY form, the state recurrence and the outputs (per chunk and
    value head: K K^T, w, u, w h, k^T v, Q K^T, Q h, P U). The backward is counted as twice the forward's
    products plus reading do and writing the input gradients."""
    C, c = 64, case
    io = c.T * (2 * c.H * c.K + c.HV * c.V + 2 * c.HV) * c.nbytes + c.T * c.HV * c.V * c.nbytes
    per_chunk = 2 * C * C * c.K * 2 + 2 * C * C * c.V * 2 + 2 * C * c.K * c.V * 3
    flops = (c.T // C) * c.HV * per_chunk
    if backward:
        return 2 * io + c.T * c.HV * c.V * c.nbytes, 3 * flops
    return io, flops


def conv_cost(backward: bool, case: Case = BENCH) -> tuple[float, float]:
    """fwd: x read, y written; fwd+bwd adds dy, x read and dx written (weights are negligible)."""
    return (5 if backward else 2) * case.T * case.conv_d * case.nbytes, 0.0


def norm_cost(backward: bool, case: Case = BENCH) -> tuple[float, float]:
    """fwd: x, gate read, y written; fwd+bwd adds x, gate, dy read and dx, dgate written."""
    return (8 if backward else 3) * case.T * case.HV * case.V * case.nbytes, 0.0


def cu_seqlens_of(case: Case, device: str | None = None) -> torch.Tensor:
    bounds = [0]
    for n in case.lengths or [case.T // case.N] * case.N:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=device or "cpu")


def gdn_tables(case: Case = BENCH):
    """cu_seqlens on the device and the host, and the chunk table: built once, as the plan does."""
    from patchgen.kernels.shared_prefix.gdn import chunk_indices

    cu_cpu = cu_seqlens_of(case)
    chunks = torch.from_numpy(chunk_indices(cu_cpu.diff().tolist()).astype("int32")).to(case.device)
    return cu_cpu.to(case.device), cu_cpu, chunks


def gdn_inputs(backward: bool, with_state: bool = False, case: Case = BENCH):
    torch.manual_seed(0)
    c, dev = case, case.device
    q = torch.randn(1, c.T, c.H, c.K, dtype=c.dtype, device=dev)
    k = torch.randn(1, c.T, c.H, c.K, dtype=c.dtype, device=dev)
    v = torch.randn(1, c.T, c.HV, c.V, dtype=c.dtype, device=dev)
    g = torch.nn.functional.logsigmoid(torch.randn(1, c.T, c.HV, device=dev))  # fp32, as Qwen3.5's layer gives it
    beta = torch.rand(1, c.T, c.HV, dtype=c.dtype, device=dev)
    ins = [q, k, v, g, beta]
    if with_state:
        ins.append(torch.randn(c.N, c.HV, c.K, c.V, device=dev) * 0.1)  # fp32, as the plan carries states
    return [t.requires_grad_(backward) for t in ins], list(gdn_tables(case))


def gdn_arms(with_state: bool, arms: tuple[str, ...] = ARMS):
    """{arm: fn(q, k, v, g, beta, [h0], cu, cu_cpu, chunks) -> (o, final)}."""
    out = {}

    def call(impl):
        def run(q, k, v, g, beta, *rest):
            h0 = rest[0] if with_state else None
            cu, cu_cpu, chunks = rest[-3:]
            return impl(q, k, v, g, beta, initial_state=h0, output_final_state=with_state,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=chunks)
        return run

    if "ours" in arms:
        from patchgen.kernels.triton import gated_delta_rule

        out["ours"] = call(gated_delta_rule)
    if "fla" in arms:
        try:
            from patchgen.kernels.backends import fla

            out["fla"] = call(fla.gated_delta_rule)
        except Exception as exc:  # noqa: BLE001 - any import failure skips the arm
            print(f"fla GDN arm skipped: {exc!r}", file=sys.stderr)
    if "torch" in arms:
        from patchgen.kernels.reference import gated_delta_rule as reference

        def torch_arm(q, k, v, g, beta, *rest):
            # The reference computes in one dtype: every input in fp32 (the state is fp32 already); a
            # bf16 q..beta next to the fp32 state was the bench bug that failed this arm (2026-11-30).
            h0 = rest[0] if with_state else None
            cu, cu_cpu, _ = rest[-3:]
            return reference.gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0,
                                              output_final_state=with_state, use_qk_l2norm_in_kernel=True,
                                              cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        out["torch"] = torch_arm
    return out


def conv_inputs(backward: bool, case: Case = BENCH):
    torch.manual_seed(0)
    x = torch.randn(1, case.T, case.conv_d, dtype=case.dtype, device=case.device, requires_grad=backward)
    w = torch.randn(case.conv_d, case.W, dtype=case.dtype, device=case.device, requires_grad=backward)
    return [x, w], [cu_seqlens_of(case, case.device)]


def conv_arms(arms: tuple[str, ...] = ARMS):
    out = {}
    if "ours" in arms:
        from patchgen.kernels.triton import causal_conv1d

        out["ours"] = lambda x, w, cu: causal_conv1d(x, w, cu_seqlens=cu)
    if "fla" in arms:
        try:
            from patchgen.kernels.backends import fla

            out["fla"] = lambda x, w, cu: fla.causal_conv1d(x, w, cu_seqlens=cu)
        except Exception as exc:  # noqa: BLE001
            print(f"fla conv arm skipped: {exc!r}", file=sys.stderr)
    if "torch" in arms:
        from patchgen.kernels.reference import causal_conv1d as reference

        out["torch"] = lambda x, w, cu: reference.causal_conv1d(x, w, cu_seqlens=cu)
    return out


def norm_inputs(backward: bool, case: Case = BENCH):
    torch.manual_seed(0)
    rows = case.T * case.HV
    x = torch.randn(rows, case.V, dtype=case.dtype, device=case.device, requires_grad=backward)
    gate = torch.randn(rows, case.V, dtype=case.dtype, device=case.device, requires_grad=backward)
    w = torch.randn(case.V, dtype=case.dtype, device=case.device, requires_grad=backward)
    return [x, gate, w], []


def norm_arms(arms: tuple[str, ...] = ARMS):
    out = {}
    if "ours" in arms:
        from patchgen.kernels.triton import rms_norm_gated

        out["ours"] = lambda x, gate, w: rms_norm_gated(x, gate, w, 1e-6)
    if "fla" in arms:
        try:
            from patchgen.kernels.backends import fla

            # the weight passed in, through the project's fla backend (fla's module would use its own
            # weight, the bench bug that made this arm's backward fail on 2026-11-30)
            out["fla"] = lambda x, gate, w: fla.rms_norm_gated(x, gate, w, 1e-6)
        except Exception as exc:  # noqa: BLE001
            print(f"fla gated-norm arm skipped: {exc!r}", file=sys.stderr)
    if "torch" in arms:
        from patchgen.kernels.reference import norms

        out["torch"] = lambda x, gate, w: norms.rms_norm_gated(x, gate, w, 1e-6)
    return out


def op_table(case: Case, arms: tuple[str, ...] = ARMS):
    """{op: (make_arms, make_inputs(backward), cost(backward))} at `case`."""
    return {
        "causal_conv1d": (lambda: conv_arms(arms), lambda b: conv_inputs(b, case), lambda b: conv_cost(b, case)),
        "rms_norm_gated": (lambda: norm_arms(arms), lambda b: norm_inputs(b, case), lambda b: norm_cost(b, case)),
        "gated_delta_rule": (lambda: gdn_arms(False, arms), lambda b: gdn_inputs(b, case=case),
                             lambda b: gdn_cost(b, case)),
        "gated_delta_rule_h0": (lambda: gdn_arms(True, arms), lambda b: gdn_inputs(b, with_state=True, case=case),
                                lambda b: gdn_cost(b, case)),
    }


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
            return torch.autograd.grad(outs, leaves, grads_out)
        return out
    return step


def run_bench(args, bandwidth, matmul, case: Case = BENCH):
    rows = []
    arms_wanted = tuple(args.arms.split(","))
    table = op_table(case, arms_wanted)
    for op in args.ops.split(","):
        make_arms, make, cost = table[op]
        arms = make_arms()
        for backward in (False, True):
            nbytes, flops = cost(backward)
            floor_ms = max(nbytes / bandwidth, flops / matmul) * 1e3
            for arm, fn in arms.items():
                is_torch = arm == "torch"
                gms = float("nan")
                try:
                    step = make_step(fn, make, backward)
                    repeats = args.torch_repeats if is_torch else args.repeats
                    ms = timed(step, repeats, warmup=1 if is_torch else args.warmup, device=case.device)
                    # the reference's host time says nothing
                    host = float("nan") if is_torch else host_ms(step, args.host_calls, case.device)
                    if not is_torch and case.device != "cpu" and op in ("causal_conv1d", "rms_norm_gated"):
                        from triton_presets import graph_ms  # no host syncs in these calls to break a capture

                        gms = graph_ms(step, args.repeats)
                    error = ""
                except Exception as exc:  # noqa: BLE001 - e.g. fla's GDN backward on Triton < 3.7.1
                    print(f"{op} {'fwd+bwd' if backward else 'fwd'} {arm} failed: {exc!r}", file=sys.stderr)
                    ms = host = float("nan")
                    error = type(exc).__name__
                rows.append({"op": op, "pass_": "fwd+bwd" if backward else "fwd", "arm": arm, "ms": ms,
                             "graph_ms": gms, "host_ms": host, "floor_ms": floor_ms, "x_floor": ms / floor_ms,
                             "error": error})
                print(f"{op} {rows[-1]['pass_']} {arm}: gpu {ms:.3f} ms, graph {gms:.3f} ms, host {host:.3f} ms",
                      flush=True)
                if case.device != "cpu":
                    torch.cuda.empty_cache()
    return rows


CSV_FIELDS = ["op", "pass", "arm", "ms", "graph_ms", "host_ms", "floor_ms", "x_floor", "graph_x_floor", "x_fla",
              "error", "case", "gpu", "triton", "torch"]


def report(rows, path, case: Case = BENCH):
    by = {(r["op"], r["pass_"], r["arm"]): r["ms"] for r in rows}
    print(f"\n{'op':<21}{'pass':<9}{'arm':<7}{'gpu ms':>9}{'graph ms':>9}{'host ms':>9}{'floor ms':>10}"
          f"{'x floor':>9}{'graph x':>9}{'x fla':>8}")
    for r in rows:
        r["x_fla"] = r["ms"] / by.get((r["op"], r["pass_"], "fla"), float("nan"))
        print(f"{r['op']:<21}{r['pass_']:<9}{r['arm']:<7}{r['ms']:>9.3f}{r['graph_ms']:>9.3f}{r['host_ms']:>9.3f}"
              f"{r['floor_ms']:>10.3f}{r['x_floor']:>9.2f}{r['graph_ms'] / r['floor_ms']:>9.2f}{r['x_fla']:>8.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    import triton
    device = torch.cuda.get_device_name() if case.device != "cpu" else "cpu"
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_FIELDS)
        for r in rows:
            writer.writerow([r["op"], r["pass_"], r["arm"], f"{r['ms']:.4f}", f"{r['graph_ms']:.4f}",
                             f"{r['host_ms']:.4f}", f"{r['floor_ms']:.4f}", f"{r['x_floor']:.3f}",
                             f"{r['graph_ms'] / r['floor_ms']:.3f}", f"{r['x_fla']:.3f}", r["error"], case.describe(),
                             device, triton.__version__, torch.__version__])
    print(f"\nwrote {path}")


def _subset(value: str, known: tuple[str, ...], flag: str) -> str:
    parts = [p.strip() for p in value.split(",") if p.strip()]
    unknown = [p for p in parts if p not in known]
    if not parts or unknown:
        raise argparse.ArgumentTypeError(f"{flag} {value!r}: unknown {unknown or 'empty list'}; "
                                         f"give a comma-separated subset of {', '.join(known)}")
    return ",".join(parts)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default=os.path.join(os.path.dirname(__file__), "results", "triton_kernels.csv"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host-calls", type=int, default=20, help="calls timed on the host per arm and pass")
    parser.add_argument("--torch-repeats", type=int, default=3)
    parser.add_argument("--ops", default=",".join(OPS), type=lambda v: _subset(v, OPS, "--ops"),
                        help="comma-separated subset of the ops to run (cheapest first)")
    parser.add_argument("--arms", default=",".join(ARMS), type=lambda v: _subset(v, ARMS, "--arms"),
                        help="comma-separated subset of the arms (the torch GDN takes seconds a call at this size)")
    parser.add_argument("--tuning", help="JSON of launch configurations written by bench/triton_tuning.py --sweep")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, Triton's interpreter, tiny widths in fp32: checks the script, measures nothing")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    case = TINY if args.tiny else BENCH
    if args.tiny:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--tiny runs Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        sys.exit("bench/triton_kernels.py needs a CUDA device (or --tiny, the CPU check of the script)")
    if args.tuning:
        from triton_tuning import apply_tuning

        apply_tuning(args.tuning)
    bandwidth, matmul = machine_rates(args.repeats, case)
    where = torch.cuda.get_device_name() if case.device != "cpu" else "cpu"
    print(f"{where}: copy {bandwidth / 1e12:.2f} TB/s, matmul {matmul / 1e12:.0f} TFLOP/s; {case.describe()}")
    rows = run_bench(args, bandwidth, matmul, case)
    report(rows, args.csv, case)
    return rows


if __name__ == "__main__":
    main()
