"""Does fla's gated-norm autotuning change a row's bits? (CUDA only.)

    python bench/norm_config_bits.py [--rows 3072,9216] [--repeats 50]

fla 0.6 tunes its gated RMSNorm forward (`layer_norm_gated_fwd_kernel`) per bucket of row count
(`NB = cdiv(rows, 65536)` is in the tuning key; rows = tokens x 32 value heads). A shared-prefix pass
runs the norm on C tokens and packed on T, so the two land in different buckets and are tuned apart.
If the configurations round a row differently, shared equals packed bit for bit only when the two
tunings happen to pick alike: bit-identity would hang on timing noise.

For each configuration the tuner may pick, on the same inputs (tokens x 32 heads rows of 128, bf16,
`--rows` token counts): the output's bits against the first configuration's, and the GPU ms per call
(median of `--repeats`). Our Triton gated norm (one launch shape for every row count) at the same sizes
for comparison, and whether its first rows are bit-equal between the two row counts.
"""

from __future__ import annotations

import argparse
import importlib

import torch
from shared_prefix_timing import gpu_ms

HEADS, WIDTH = 32, 128


def under_each_config(kernel, call):
    """`[(config, output)]`: `call()` with the autotuned `kernel` held to one configuration at a time."""
    saved = kernel.configs
    results = []
    try:
        for config in saved:
            kernel.configs = [config]
            kernel.cache.clear()
            results.append((config, call()))
    finally:
        kernel.configs = saved
        kernel.cache.clear()
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="3072,9216", help="token counts (x 32 heads rows each)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    from fla.modules.norm import fused_norm_gate
    from patchgen.kernels.backends import fla as fla_backend
    ours = importlib.import_module("patchgen.kernels.triton.rms_norm_gated")  # the module (the package exports its function)

    kernel = fused_norm_gate.layer_norm_gated_fwd_kernel
    while not hasattr(kernel, "configs"):  # the autotuner under fla's heuristics
        kernel = kernel.fn
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = [int(t) for t in args.rows.split(",")]
    largest = max(tokens) * HEADS
    x = torch.randn(largest, WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)
    gate = torch.randn(largest, WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = 1 + 0.1 * torch.randn(WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)
    print(f"fla gated norm forward, {len(kernel.configs)} configurations, key {kernel.keys}", flush=True)
    for count in tokens:
        rows = count * HEADS
        xs, gs = x[:rows], gate[:rows]

        def fla_call(xs=xs, gs=gs):
            return fla_backend.rms_norm_gated(xs, gs, weight, 1e-6)

        runs = under_each_config(kernel, lambda: (fla_call(), gpu_ms(fla_call, args.repeats)))
        first = runs[0][1][0]
        for config, (out, ms) in runs:
            differing = int((out != first).any(dim=1).sum())
            print(f"  tokens {count} (rows {rows}, NB {-(-rows // 65536)}): {config}: {ms:.4f} ms, rows differing "
                  f"from the first configuration {differing}/{rows}", flush=True)
        ours_call = lambda xs=xs, gs=gs: ours.rms_norm_gated(xs, gs, weight, 1e-6)
        print(f"  tokens {count}: ours {gpu_ms(ours_call, args.repeats):.4f} ms", flush=True)
    small = min(tokens) * HEADS
    a = ours.rms_norm_gated(x[:small], gate[:small], weight, 1e-6)
    b = ours.rms_norm_gated(x, gate, weight, 1e-6)[:small]
    print(f"ours: first {small} rows bit-equal between {small} and {largest} rows: {torch.equal(a, b)}", flush=True)


if __name__ == "__main__":
    main()
