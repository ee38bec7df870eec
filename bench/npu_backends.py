"""Forward+backward time and error of every torch_npu backend against the reference it replaces (Ascend NPU).

Per slot, on the same bf16 inputs: the torch_npu backend and the backend the npu target used before
(`sdpa` for attention, the torch references otherwise), timed as the median of ``--repeats`` runs
after ``--warmup``, with a device synchronize around each; errors are relative (Frobenius) against
the float32 reference on the same inputs. Shapes follow Qwen3.5-35B-A3B-like widths: attention 16
query / 2 key-value heads of 256 over T tokens in ``--sequences`` sequences, hidden 2048, rotary
dim 64, MLP 512 per expert with 256 experts, top-8. ``--tiny`` shrinks everything for a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_backends import report  # bench/ is on sys.path when a script of it runs
from patchgen.kernels import registry

PAIRS = {  # slot: (torch_npu backend, the backend it replaces, the float32 reference)
    "attention": ("npu_fusion_attention", "sdpa", "eager"),
    "rms_norm": ("npu_rms_norm", "torch", "torch"),
    "rotary": ("npu_rotary_mul", "torch", "torch"),
    "swiglu_mlp": ("npu_swiglu", "torch", "torch"),
    "moe_experts": ("npu_grouped_matmul", "eager", "eager"),
}
FULL = dict(heads=16, kv_heads=2, head_dim=256, hidden=2048, rotary=64, intermediate=512, experts=256, top_k=8)
TINY = dict(heads=4, kv_heads=2, head_dim=16, hidden=32, rotary=8, intermediate=16, experts=8, top_k=2)


def make_case(slot: str, tokens: int, sequences: int, shape: dict, device, dtype):
    """(differentiable inputs, constants, run(fn, leaves) -> output tensors) for one slot."""
    gen = torch.Generator().manual_seed(0)

    def randn(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device=device, dtype=dtype)

    if slot == "attention":
        cu = torch.linspace(0, tokens, sequences + 1).round().to(torch.int32).to(device)
        longest = int((cu[1:] - cu[:-1]).max())
        h, kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
        leaves = [randn(tokens, h, d), randn(tokens, kv, d), randn(tokens, kv, d)]

        def run(fn, x):
            return [fn(*x, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                       scale=d**-0.5)]
        return leaves, run
    if slot == "rms_norm":
        leaves = [randn(tokens, shape["hidden"]), randn(shape["hidden"], scale=0.1)]
        return leaves, lambda fn, x: [fn(x[0], x[1], 1e-6)]
    if slot == "rotary":
        angles = torch.rand(1, tokens, shape["rotary"] // 2, generator=gen) * 6
        cos, sin = (torch.cat((f(angles), f(angles)), -1).to(device=device, dtype=dtype) for f in (torch.cos, torch.sin))
        leaves = [randn(1, shape["heads"], tokens, shape["head_dim"]), randn(1, shape["kv_heads"], tokens, shape["head_dim"])]
        return leaves, lambda fn, x: list(fn(x[0], x[1], cos.to(x[0].dtype), sin.to(x[0].dtype)))
    if slot == "swiglu_mlp":
        d, i = shape["hidden"], shape["intermediate"] * shape["top_k"]
        leaves = [randn(tokens, d), randn(i, d, scale=d**-0.5), randn(i, d, scale=d**-0.5), randn(d, i, scale=i**-0.5)]
        return leaves, lambda fn, x: [fn(*x)]
    if slot == "moe_experts":
        d, i, e, k = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
        index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(device)
        weights = torch.rand(tokens, k, generator=gen).softmax(-1).to(device)
        leaves = [randn(tokens, d), randn(e, 2 * i, d, scale=d**-0.5), randn(e, d, i, scale=i**-0.5)]
        return leaves, lambda fn, x: [fn(x[0], index, weights.to(x[0].dtype), x[1], x[2], F.silu)]
    raise ValueError(f"unknown slot {slot!r}; slots are {list(PAIRS)}")


def synchronize(device) -> None:
    if device.type == "npu":
        torch.npu.synchronize()


def forward_backward(fn, run, leaves, seeds):
    for x in leaves:
        x.grad = None
    outs = run(fn, leaves)
    torch.autograd.backward(outs, [s.to(o.dtype) for o, s in zip(outs, seeds)])
    return [o.detach() for o in outs], [x.grad.detach() for x in leaves]


def time_ms(fn, run, leaves, seeds, device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        forward_backward(fn, run, leaves, seeds)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        forward_backward(fn, run, leaves, seeds)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_slot(slot: str, args, device, dtype) -> list[dict]:
    shape = TINY if args.tiny else FULL
    base, run = make_case(slot, args.tokens, args.sequences, shape, device, dtype)
    npu_name, before, reference = PAIRS[slot]
    ref_leaves = [x.detach().float().requires_grad_() for x in base]
    ref_fn = registry.handle(slot, reference).load()
    seeds = [torch.randn_like(o) for o in run(ref_fn, ref_leaves)]
    ref_outs, ref_grads = forward_backward(ref_fn, run, ref_leaves, seeds)
    rows = []
    for name in (npu_name, before):
        handle = registry.handle(slot, name)
        row = {"slot": slot, "backend": name, "ms_fwd_bwd": "", "out_rel_err": "", "max_grad_rel_err": "", "note": ""}
        if not handle.available:
            rows.append({**row, "note": handle.reason})
            continue
        fn, leaves = handle.load(), [x.detach().requires_grad_() for x in base]
        try:
            outs, grads = forward_backward(fn, run, leaves, seeds)
            row["out_rel_err"] = f"{max(rel(a, b) for a, b in zip(outs, ref_outs)):.2e}"
            row["max_grad_rel_err"] = f"{max(rel(a, b) for a, b in zip(grads, ref_grads)):.2e}"
            row["ms_fwd_bwd"] = f"{time_ms(fn, run, leaves, seeds, device, args.warmup, args.repeats):.3f}"
        except Exception as exc:  # noqa: BLE001 - a failing backend is a result, not a crash
            row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slots", nargs="*", default=list(PAIRS))
    parser.add_argument("--tiny", action="store_true", help="tiny widths, for a smoke run")
    parser.add_argument("--device", default="npu", help="npu (default); cpu only with a stand-in torch_npu")
    parser.add_argument("--csv", type=Path, default=Path("bench/results/npu_backends.csv"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "npu" and not registry.npu_available():
        print("needs an Ascend NPU (torch_npu installed and torch.npu.is_available())", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "npu" else torch.float32
    rows = [row for slot in args.slots for row in bench_slot(slot, args, device, dtype)]
    report(rows, f"{device}, {dtype}, torch {torch.__version__}, T={args.tokens} in {args.sequences} sequences", args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
