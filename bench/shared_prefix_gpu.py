"""Shared-prefix vs packed training on one GPU, at Qwen3.5-4B widths, in one run.

    python bench/shared_prefix_gpu.py --out DIR [--shapes 4x2048x256,8x4096x256] [--layers 8]
    python bench/shared_prefix_gpu.py --tiny          # CPU smoke test of the script itself

Builds `Qwen3_5ForCausalLM` from the generated GPU module (hidden 2560, intermediate 9216, 16
attention heads of 256 with 4 KV heads, GDN 16/32 heads of 128, conv 4, vocab 151936; `--layers`
in the pattern 3 linear + 1 full), bf16, gradient checkpointing, random weights. Per shape
(n rollouts of a P-token prompt with R-token responses, whole groups in one micro-batch) it times
the training step (forward + backward) and the log-prob pass (forward only) with the flag off
(packed) and on (shared prefix), with CUDA events after warm-up (Triton autotune excluded), median
and spread of repeats, peak memory per arm, plan-build time, and host syncs on the shared path.
It also runs the correctness check of the generated-models issue: bf16 flag-on vs flag-off
distance of logits, loss and gradients, against the packed-vs-unpacked noise floor.
Writes `shared_prefix_<device>.csv` and `correctness_<device>.csv` under --out and prints tables.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import statistics
import time
import warnings
from pathlib import Path

import torch

MODULE = "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu"
WIDTHS = dict(
    hidden_size=2560, intermediate_size=9216, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=151936,
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, vocab_size=512,
)


def config_for(widths: dict, layers: int):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        num_hidden_layers=layers, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        tie_word_embeddings=False, use_cache=False, **widths,
    )
    config.shared_prefix_training = False
    return config


def batch(groups: list[tuple[int, int, int]], singles: list[int], vocab: int, device, seed: int = 0):
    """Packed row of whole groups `(n, P, R)` then unrelated sequences; labels = input ids."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for n, p, r in groups:
        prompt = torch.randint(0, vocab, (p,), generator=gen)
        seqs += [torch.cat([prompt, torch.randint(0, vocab, (r,), generator=gen)]) for _ in range(n)]
    seqs += [torch.randint(0, vocab, (s,), generator=gen) for s in singles]
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    ids = torch.cat(seqs).unsqueeze(0)
    return ids.to(device), cu.to(device), max(lengths), seqs


class Timer:
    """CUDA events on a GPU, the host clock (after a sync) elsewhere."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3


def packed_kwargs(cu, max_len):
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)


def train_step(model, ids, cu, max_len):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=boundary_labels(ids, cu), return_logits=False, **packed_kwargs(cu, max_len))
    out.loss.backward()


def logprob_pass(model, ids, cu, max_len):
    with torch.no_grad():
        model(input_ids=ids, return_log_probs=True, return_logits=False, **packed_kwargs(cu, max_len))


def measure(model, fn, args, timer, warmup, repeats, device):
    for _ in range(warmup):
        fn(model, *args)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [timer(lambda: fn(model, *args)) for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times), min(times), max(times), peak


def count_syncs(model, ids, cu, max_len, device) -> int:
    """Host syncs during one shared-prefix training step (torch's sync debug mode, as warnings)."""
    if device.type != "cuda":
        return -1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(model, ids, cu, max_len)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def plan_build_ms(ids, cu, timer, repeats=10) -> float:
    from patchgen.kernels.shared_prefix import build_plan

    build_plan(ids, cu)
    return statistics.median(timer(lambda: build_plan(ids, cu)) for _ in range(repeats))


def speed(model, shapes, args, device, timer, vocab):
    from patchgen.kernels.shared_prefix import build_plan

    rows = []
    for name, groups, singles in shapes:
        ids, cu, max_len, _ = batch(groups, singles, vocab, device)
        plan = build_plan(ids, cu)
        total = ids.shape[1]
        compact = plan.compact_length if plan is not None else total
        row = {"shape": name, "T": total, "C": compact, "bound": total / compact}
        for flag in (False, True):
            model.config.shared_prefix_training = flag
            arm = "shared" if flag else "packed"
            for kind, fn in (("train", train_step), ("logprob", logprob_pass)):
                med, low, high, peak = measure(model, fn, (ids, cu, max_len), timer, args.warmup, args.repeats, device)
                row[f"{arm}_{kind}_ms"], row[f"{arm}_{kind}_min"], row[f"{arm}_{kind}_max"] = med, low, high
                row[f"{arm}_{kind}_peak_gib"] = peak
        row["syncs_shared_train"] = count_syncs(model, ids, cu, max_len, device)
        model.config.shared_prefix_training = False
        row["plan_ms"] = plan_build_ms(ids, cu, timer)
        for kind in ("train", "logprob"):
            row[f"speedup_{kind}"] = row[f"packed_{kind}_ms"] / row[f"shared_{kind}_ms"]
            row[f"efficiency_{kind}"] = row[f"speedup_{kind}"] / row["bound"]
        row["memory_ratio_train"] = row["shared_train_peak_gib"] / row["packed_train_peak_gib"]
        rows.append(row)
        print(f"{name}: T={total} C={compact} bound={row['bound']:.2f} train {row['packed_train_ms']:.0f} -> "
              f"{row['shared_train_ms']:.0f} ms (eff {row['efficiency_train']:.2f}), logprob eff "
              f"{row['efficiency_logprob']:.2f}, mem {row['memory_ratio_train']:.2f}, syncs {row['syncs_shared_train']}",
              flush=True)
    return rows


def grads_of(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def boundary_labels(ids, cu):
    """Labels = input ids, -100 at each sequence start: no token predicts across a packed boundary."""
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    return labels


def run_arm(model, ids, cu, max_len, flag, n_items):
    model.config.shared_prefix_training = flag
    model.zero_grad(set_to_none=True)
    labels = boundary_labels(ids, cu)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=n_items, **packed_kwargs(cu, max_len))
    out.loss.backward()
    return out.logits.detach().float(), out.loss.detach().float(), grads_of(model)


def run_unpacked(model, seqs, device, n_items):
    """Each sequence alone (no packing), losses summed with the packed normalisation."""
    model.config.shared_prefix_training = False
    model.zero_grad(set_to_none=True)
    logits, loss = [], 0.0
    for seq in seqs:
        ids = seq.unsqueeze(0).to(device)
        out = model(input_ids=ids, labels=ids, num_items_in_batch=n_items)
        out.loss.backward()
        logits.append(out.logits.detach().float())
        loss = loss + out.loss.detach().float()
    return torch.cat(logits, dim=1), loss, grads_of(model)


def distance(a, b):
    """(max |a-b|, ||a-b|| / ||b||) over tensors or dicts of tensors."""
    if isinstance(a, dict):
        pairs = [(a[k], b[k]) for k in b]
        num = sum((x - y).pow(2).sum() for x, y in pairs).sqrt()
        den = sum(y.pow(2).sum() for _, y in pairs).sqrt()
        return max((x - y).abs().max().item() for x, y in pairs), (num / den).item()
    return (a - b).abs().max().item(), ((a - b).norm() / b.norm()).item()


def correctness(model, device, vocab, case):
    n, p, r, single = case
    ids, cu, max_len, seqs = batch([(n, p, r)], [single], vocab, device, seed=1)
    n_items = ids.shape[1] - len(seqs)  # shifted labels: one fewer per sequence
    off = run_arm(model, ids, cu, max_len, False, n_items)
    on = run_arm(model, ids, cu, max_len, True, n_items)
    alone = run_unpacked(model, seqs, device, n_items)
    rows = []
    for i, what in enumerate(("logits", "loss", "grads")):
        sp_max, sp_rel = distance(on[i], off[i])
        nf_max, nf_rel = distance(alone[i], off[i])
        rows.append({"quantity": what, "shared_vs_packed_max": sp_max, "shared_vs_packed_rel": sp_rel,
                     "noise_floor_max": nf_max, "noise_floor_rel": nf_rel,
                     "within_2x_floor": sp_rel <= 2 * max(nf_rel, 1e-30)})
        print(f"{what:>6}: shared-vs-packed rel {sp_rel:.2e} (max {sp_max:.2e}); packed-vs-unpacked rel "
              f"{nf_rel:.2e} (max {nf_max:.2e})", flush=True)
    model.config.shared_prefix_training = False
    return rows


def write(rows, path: Path):
    if not rows:
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def parse_shapes(text: str):
    shapes = []
    for item in text.split(","):
        if item == "split":  # one group of 8 split over two micro-batches: each half seen alone
            shapes.append(("split 4of8 P=2048 R=256", [(4, 2048, 256)], []))
        elif item == "system":  # two prompts sharing only a 1k system prompt: two groups
            shapes.append(("system-only 2x4 P=1024+512 R=256", [(4, 1536, 256), (4, 1536, 256)], []))
        else:
            n, p, r = (int(v) for v in item.split("x"))
            shapes.append((f"n={n} P={p} R={r}", [(n, p, r)], []))
    return shapes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4x1024x256,8x2048x256,8x4096x256")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--correctness", default="3x1990x96x300", help="n x P x R x unrelated length; '' skips")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tiny", action="store_true", help="tiny widths on the CPU, float32 (script smoke test)")
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    widths = TINY if args.tiny else WIDTHS
    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    with torch.device(device):
        model = module.Qwen3_5ForCausalLM(config_for(widths, args.layers)).to(dtype)
    model.gradient_checkpointing_enable()
    model.train()
    from patchgen.kernels import ops

    print(ops.of(model).describe(), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = "cpu-tiny" if args.tiny else torch.cuda.get_device_name().replace(" ", "_")
    if args.correctness:
        n, p, r, single = (int(v) for v in args.correctness.split("x"))
        if args.tiny:
            p, r, single = 130, 20, 50
        write(correctness(model, device, widths["vocab_size"], (n, p, r, single)), out / f"correctness_{label}.csv")
    shapes = parse_shapes(args.shapes)
    if args.tiny:
        shapes = [("tiny n=4 P=192 R=32", [(4, 192, 32)], [40])]
    rows = speed(model, shapes, args, device, Timer(device), widths["vocab_size"])
    write(rows, out / f"shared_prefix_{label}.csv")


if __name__ == "__main__":
    main()
