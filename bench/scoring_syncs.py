"""Where a scoring call waits for the device, and the scoring head against liger's (CUDA only).

    python bench/scoring_syncs.py    # on the lent machine: PYTHONSAFEPATH=1 PYTHONPATH=bench (docs/bench/README.md)

1. Every host sync of one log-prob call (`return_log_probs`, no gradients) of the generated GPU model, 4 layers
   at the 4B head widths, one GRPO group of 4: packed and shared, with the row on the device, on the host
   (`kernels/modeling/host_rows.py`), and on the host without labels. Each sync is printed with the frames that
   made it (torch's sync debug mode, which reports the syncs it knows of: `.item()`, `.cpu()`, `nonzero`, ...).
   Every call gets new tensors, as a loop's micro-batches do (a backend may keep what it derived per tensor).
2. The LM head of a scoring pass: liger's fused head against the `triton` backend (`kernels/triton/log_probs.py`)
   at hidden 2560 and vocabulary 151936, bf16: ms per call (mean of 5) and the largest nll difference.
"""

from __future__ import annotations

import argparse
import importlib
import traceback

import torch
from shared_prefix_timing import sync_sites

MODULE = "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu"
WIDTHS = dict(
    hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=8192,
)
PROMPT, RESPONSES = 700, (90, 300, 128, 64)


def model():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                               tie_word_embeddings=False, use_cache=False, **WIDTHS)
    config.shared_prefix_plan_reuse = False
    torch.manual_seed(0)
    with torch.device("cuda"):
        return importlib.import_module(MODULE).Qwen3_5ForCausalLM(config).bfloat16().eval()


def group():
    """One packed row of a prompt and its responses (host tensors), labels masking the prompt."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, WIDTHS["vocab_size"], (PROMPT,), generator=gen)
    seqs = [torch.cat([prompt, torch.randint(0, WIDTHS["vocab_size"], (r,), generator=gen)]) for r in RESPONSES]
    ids = torch.cat(seqs).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    labels = ids.clone()
    for start in cu[:-1].tolist():
        labels[0, start : start + PROMPT] = -100
    return ids, cu, labels


def score(net, ids, cu, labels, longest):
    """`longest` from the host boundaries: read from a device `cu` it would be a sync of this script's own."""
    with torch.no_grad():
        return net(input_ids=ids, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                   max_length_k=longest, return_log_probs=True, return_logits=False).log_probs


def ours_and_libraries() -> str:
    """The innermost frames of ours and our libraries' at a sync, innermost first."""
    frames = [f for f in traceback.extract_stack()[:-2] if "patchgen" in f.filename or "site-packages" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}({f.name})" for f in frames[-4:][::-1])


def head_comparison(rows: int, repeats: int = 5) -> str:
    from patchgen.kernels.backends.liger import cross_entropy as liger
    from patchgen.kernels.triton.log_probs import cross_entropy as ours

    hidden = torch.randn(rows, 2560, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(151936, 2560, device="cuda") * 0.02).bfloat16()
    targets = torch.randint(0, 151936, (rows,), device="cuda")
    ms = {}
    with torch.no_grad():
        nll = {name: fn(hidden, weight, targets)[0] for name, fn in (("liger", liger), ("ours", ours))}
        for name, fn in (("liger", liger), ("ours", ours)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(repeats):
                fn(hidden, weight, targets)
            end.record()
            torch.cuda.synchronize()
            ms[name] = start.elapsed_time(end) / repeats
    diff = (nll["liger"] - nll["ours"]).abs()
    rel = (diff / nll["liger"].abs().clamp_min(1e-6)).max().item()
    return (f"head rows {rows}: liger {ms['liger']:.2f} ms, ours {ms['ours']:.2f} ms; nll max abs difference "
            f"{diff.max().item():.2e}, max relative {rel:.2e}")


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/scoring_syncs.py needs a CUDA device (it counts host syncs with torch's CUDA sync debug mode)")
    net = model()
    ids, cu, labels = group()
    longest = int((cu[1:] - cu[:-1]).max())
    for shared in (False, True):
        net.config.shared_prefix_training = shared
        arms = {"on the device": lambda: [t.cuda() for t in (ids, cu, labels)],
                "on the host": lambda: [ids.clone(), cu.clone(), labels.clone()],
                "on the host, no labels": lambda: [ids.clone(), cu.clone(), None]}
        for where, rows in arms.items():
            for _ in range(2):
                score(net, *rows(), longest)  # warm: tuning, first-use verification
            batch = rows()
            with sync_sites(ours_and_libraries) as sites:
                score(net, *batch, longest)
            print(f"{'shared' if shared else 'packed'}, row {where}: {len(sites)} syncs")
            for site in sites:
                print(f"    {site}")
    for rows in (3075, 6147, 9216):
        print(head_comparison(rows))


if __name__ == "__main__":
    main()
