"""Forward+backward time and error of every GDN, conv and attention backend (GPU).

Qwen3.5-4B widths: gated delta rule with 16 key heads, 32 value heads, head dims 128; the
short conv over the 8192 mixed q/k/v channels (width 4); attention with 16 query heads, 4
key/value heads, head dim 256. One packed row of T = 16384 tokens in 4 sequences, bf16.
Times are CUDA-event medians; error is |out - ref| / |ref| (Frobenius) against the torch
reference run in fp32 on the same bf16 inputs, for the output and the input gradients.

    python bench/kernel_backends.py --csv bench/results/kernel_backends.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from patchgen.kernels import registry

SLOT_BACKENDS = {
    "gated_delta_rule": ("fla", "triton", "torch"),
    "causal_conv1d": ("fla", "triton", "torch"),
    "attention": (
        "flash_attention_2",
        "flash_attention_3",
        "flash_attention_4",
        "torch_varlen",
        "sdpa",
        "eager",
    ),
}


def make_case(slot: str, args) -> tuple[list[torch.Tensor], dict, callable]:
    """Inputs (bf16 leaves), keyword arguments, and a function of (fn, leaves) -> outputs."""
    T, n = args.tokens, args.sequences
    cu = torch.linspace(0, T, n + 1, device="cuda").round().to(torch.int32)
    randn = lambda *s, scale=1.0: (torch.randn(*s, device="cuda") * scale).to(torch.bfloat16)
    if slot == "gated_delta_rule":
        H, HV, K = 16, 32, 128
        leaves = [
            randn(1, T, H, K),
            randn(1, T, H, K),
            randn(1, T, HV, K),
            F.logsigmoid(torch.randn(1, T, HV, device="cuda") + 3),
            torch.rand(1, T, HV, device="cuda").to(torch.bfloat16),
            torch.randn(n, HV, K, K, device="cuda") * 0.1,
        ]
        kwargs = {
            "output_final_state": True,
            "use_qk_l2norm_in_kernel": True,
            "cu_seqlens": cu,
            "cu_seqlens_cpu": cu.cpu(),
        }

        def run(fn, x):
            o, final = fn(*x[:5], initial_state=x[5].float(), **kwargs)
            return [o, final]

        return leaves, kwargs, run
    if slot == "causal_conv1d":
        D = 16 * 128 * 2 + 32 * 128
        leaves = [randn(1, T, D), randn(D, 4, scale=0.5)]
        return leaves, {}, lambda fn, x: [fn(x[0], x[1], None, activation="silu", cu_seqlens=cu)]
    H, Hkv, Dh = 16, 4, 256
    leaves = [randn(T, H, Dh), randn(T, Hkv, Dh), randn(T, Hkv, Dh)]
    max_len = int(cu.diff().max())
    kwargs = {
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": max_len,
        "max_seqlen_k": max_len,
        "scale": Dh**-0.5,
    }
    return leaves, kwargs, lambda fn, x: [fn(*x, **kwargs)]


def forward_backward(fn, run, leaves, seeds):
    outs = run(fn, leaves)
    loss = sum((o.float() * s).sum() for o, s in zip(outs, seeds))
    grads = torch.autograd.grad(loss, [x for x in leaves if x.requires_grad])
    return outs, grads


def time_ms(fn, run, leaves, seeds, warmup, repeats) -> float:
    for _ in range(warmup):
        forward_backward(fn, run, leaves, seeds)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward_backward(fn, run, leaves, seeds)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_slot(slot: str, args) -> list[dict]:
    torch.manual_seed(0)
    base, _, run = make_case(slot, args)
    leaves = [x.detach().requires_grad_() for x in base]
    reference = registry.handle(slot, "eager" if slot == "attention" else "torch").load()
    ref_leaves = [x.detach().float().requires_grad_() for x in base]
    ref_outs = run(reference, ref_leaves)
    seeds = [torch.randn_like(o) for o in ref_outs]
    ref_outs, ref_grads = forward_backward(reference, run, ref_leaves, seeds)
    rows = []
    for name in SLOT_BACKENDS[slot]:
        handle = registry.handle(slot, name)
        row = {
            "slot": slot,
            "backend": name,
            "ms_fwd_bwd": "",
            "out_rel_err": "",
            "max_grad_rel_err": "",
            "note": "",
        }
        if not handle.available:
            rows.append({**row, "note": handle.reason})
            continue
        fn = handle.load()
        try:
            outs, grads = forward_backward(fn, run, leaves, seeds)
            row["out_rel_err"] = f"{max(rel(a, b) for a, b in zip(outs, ref_outs)):.2e}"
            row["max_grad_rel_err"] = f"{max(rel(a, b) for a, b in zip(grads, ref_grads)):.2e}"
            row["ms_fwd_bwd"] = f"{time_ms(fn, run, leaves, seeds, args.warmup, args.repeats):.2f}"
        except Exception as exc:  # noqa: BLE001 - a failing backend is a result, not a crash
            row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        torch.cuda.empty_cache()
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--slots", nargs="*", default=list(SLOT_BACKENDS))
    parser.add_argument("--csv", type=Path, default=Path("bench/results/kernel_backends.csv"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    rows = [row for slot in args.slots for row in bench_slot(slot, args)]
    title = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, T={args.tokens} in {args.sequences} sequences"
    report(rows, title, args.csv)
    return 0


def report(rows: list[dict], title: str, path: Path) -> None:
    """Print the rows as a table (the last column, `note`, unpadded) and write them as CSV."""
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns[:-1]}
    print(title)
    print("  ".join(c.ljust(widths[c]) for c in columns[:-1]) + "  note")
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in columns[:-1]) + "  " + r["note"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
