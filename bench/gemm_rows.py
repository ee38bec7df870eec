"""What a row count costs the projections of one layer group: GEMM time at a list of row counts (H200).

    python bench/gemm_rows.py [--rows 6144,6272,6277,6400] [--repeats 50]

The graphed passes pad the compact row to a bucket (`kernels/shared_prefix/bucket.py`: 6144 rows become 6277 at
n=8 P=4096 R=256). A GEMM computes whole tiles of rows, so its time may step with the tile count rather than grow
with the rows: 6144 rows are 48 tiles of 128, 6272 are 49, 6277 are 50. This times every projection of one group of
four layers (three Gated DeltaNet, one attention, each with its MLP) at the 4B widths, in bf16, at each row count,
and gives each total against the first count's, beside the ratio of rows: whether a bucket ladder of whole tiles
would pad for less.

Off CUDA (`--tiny`) it runs tiny widths once: it checks the script, it measures nothing.
"""

from __future__ import annotations

import argparse

import torch
from shared_prefix_arms import WIDTHS, config_for
from shared_prefix_timing import gpu_ms
from torch import nn

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, vocab_size=1000)


def projections(widths: dict) -> list[tuple[int, int]]:
    """(in, out) of every `nn.Linear` in one group of four layers of the generated GPU module, built on the meta
    device (the LM head is left out: it scores labelled rows, not the compact row)."""
    import importlib

    from shared_prefix_arms import MODULE

    module = importlib.import_module(MODULE)
    with torch.device("meta"):
        model = module.Qwen3_5ForCausalLM(config_for(widths, 4))
    return [(m.in_features, m.out_features) for name, m in model.model.named_modules() if isinstance(m, nn.Linear)]


def time_ms(fn, repeats: int, device) -> float:
    if device.type != "cuda":
        fn()
        return 0.0
    return gpu_ms(fn, repeats)


def measure(rows: list[int], shapes: list[tuple[int, int]], repeats: int, device) -> list[float]:
    """ms of every projection in `shapes` at each row count (forward, bf16 on CUDA)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weights = [torch.randn(out, inp, device=device, dtype=dtype) for inp, out in shapes]
    out = []
    for m in rows:
        inputs = [torch.randn(m, inp, device=device, dtype=dtype) for inp, _ in shapes]
        out.append(sum(time_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), repeats, device)
                       for x, w in zip(inputs, weights)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="6144,6272,6277,6400", help="row counts; ratios are to the first")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="tiny widths on the CPU: checks the script, measures nothing")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    rows = [int(r) for r in args.rows.split(",")]
    shapes = projections(TINY if args.tiny else WIDTHS)
    found = measure(rows, shapes, 1 if device.type != "cuda" else args.repeats, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (measures nothing)"
    print(f"{name}: {len(shapes)} projections of one 4-layer group, forward, ms (median of {args.repeats})")
    print("rows     ms  ratio  rows ratio  tiles of 128")
    for m, ms in zip(rows, found):
        ratio = ms / found[0] if found[0] else float("nan")
        print(f"{m:5d} {ms:7.3f} {ratio:6.3f} {m / rows[0]:11.3f} {-(-m // 128):13d}")
    return dict(zip(rows, found)), shapes


if __name__ == "__main__":
    main()
