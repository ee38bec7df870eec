"""Packed vs shared-prefix training, side by side: `make demo` or `python -m patchgen.kernels.modeling.demo`.

Builds a small Qwen3.5 from a generated module on the CPU (float64, torch backends, random weights, no
network), runs one training step (forward + backward) on a GRPO-like packed batch with the flag off
and one with it on, and prints the token counts, the bound T / C, the time of each step and the
largest difference of loss and gradients.
"""

from __future__ import annotations

import argparse
import time

import torch

MODULE = "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_npu"


def grpo_batch(prompts: int, rollouts: int, prompt_len: int, response_len: int, singles: list[int], vocab: int, seed: int):
    """One packed row: each prompt followed by its rollouts' responses, then unrelated sequences."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
        for _ in range(rollouts):
            seqs.append(torch.cat([prompt, torch.randint(0, vocab, (response_len,), generator=gen)]))
    seqs += [torch.randint(0, vocab, (n,), generator=gen) for n in singles]
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    return torch.cat(seqs).unsqueeze(0), cu


def tiny_config(layers: int, vocab: int, flag: bool):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        tie_word_embeddings=False, use_cache=False,
    )
    config.shared_prefix_training = flag
    config.ops_implementation = {"gated_delta_rule": "torch", "causal_conv1d": "torch", "rms_norm_gated": "torch"}
    return config


def step(flag: bool, args, input_ids, cu, labels):
    import importlib

    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    model = module.Qwen3_5ForCausalLM(tiny_config(args.layers, args.vocab, flag)).double()
    best = float("inf")
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        length = int(cu[1:].sub(cu[:-1]).max())
        out = model(input_ids=input_ids, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=length, max_length_k=length)
        out.loss.backward()
        best = min(best, time.perf_counter() - start)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=448)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--single", type=int, default=200, help="length of one unrelated sequence")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from patchgen.kernels.shared_prefix import build_plan

    input_ids, cu = grpo_batch(args.prompts, args.rollouts, args.prompt_len, args.response_len,
                               [args.single], args.vocab, seed=0)
    labels = input_ids.clone()
    plan = build_plan(input_ids, cu)
    total, compact = input_ids.shape[1], plan.compact_length

    loss_off, grads_off, t_off = step(False, args, input_ids, cu, labels)
    loss_on, grads_on, t_on = step(True, args, input_ids, cu, labels)
    grad_diff = max((grads_on[n] - grads_off[n]).abs().max().item() for n in grads_off)
    largest = max(g.abs().max().item() for g in grads_off.values())
    bound = total / compact
    rows = [
        ("batch", (f"{args.prompts} prompts x {args.rollouts} rollouts (P={args.prompt_len}, "
                   f"R={args.response_len}) + 1 x {args.single}")),
        ("model", f"Qwen3.5 {args.layers} layers, d=128, float64, CPU torch backends (npu module)"),
        ("tokens packed T", f"{total}"),
        ("tokens compact C", f"{compact}"),
        ("bound T / C", f"{bound:.2f}"),
        (f"packed step (fwd+bwd, best of {args.repeats})", f"{t_off * 1e3:.0f} ms"),
        ("shared-prefix step", f"{t_on * 1e3:.0f} ms"),
        ("speed-up", f"{t_off / t_on:.2f}x ({t_off / t_on / bound:.2f} of the bound)"),
        ("loss packed / shared", f"{loss_off.item():.10f} / {loss_on.item():.10f}"),
        ("max |loss diff|", f"{(loss_on - loss_off).abs().item():.2e}"),
        ("max |grad diff|", f"{grad_diff:.2e} (largest grad {largest:.2e}, {len(grads_off)} tensors)"),
    ]
    print("shared-prefix demo: one packed vs one shared-prefix training step")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    main()
