"""GRPO scoring and training step through TRL: stock GRPOTrainer vs SharedPrefixGRPOTrainer.

    python bench/grpo_trl.py                                  # CPU, tiny widths (float32)
    python bench/grpo_trl.py --widths 4b --layers 8 --out docs/bench/grpo_trl_NVIDIA_H200.csv   # one H200, bf16

One micro-batch of GRPO rollouts (``--prompts`` groups of ``--rollouts`` completions of up to
``--response-len`` tokens after a ``--prompt-len``-token prompt; completion lengths vary, so the
padded rows carry right padding) is scored by the trainers' own code paths, on one generated
``Qwen3_5ForCausalLM`` (GPU module, random weights), three arms:

- ``stock``: ``trl.GRPOTrainer``, flag off (TRL's padded ``[B, L]`` rows through the backbone and
  its fused LM head);
- ``packed``: ``SharedPrefixGRPOTrainer``, flag off (one packed row, no sharing);
- ``shared``: ``SharedPrefixGRPOTrainer``, flag on (each prompt once).

Scoring = the old-policy / reference pass (``_get_per_token_logps_and_entropies`` under no_grad);
training step = ``compute_loss`` (policy pass with entropy, TRL's loss) + backward. Median of
``--repeats`` after ``--warmup``; CUDA synchronised around each. Prints a table, writes a CSV, and
checks that the arms' losses agree (float32 rounding of TRL's fused head on the stock arm).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODULE = "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu"
WIDTHS = {
    # Qwen3.5-4B's widths (vocab as the published config); the layer count is --layers.
    "4b": dict(hidden_size=2560, intermediate_size=9216, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                 vocab_size=512),
}
ARMS = ("stock", "packed", "shared")


def build_model(widths: str, layers: int, dtype: torch.dtype, device: str):
    import importlib

    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        num_hidden_layers=layers, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        linear_conv_kernel_dim=4, tie_word_embeddings=False, use_cache=True, **WIDTHS[widths],
    )
    config.shared_prefix_min_length = 64
    config.eos_token_id = config.pad_token_id = 0
    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    with torch.device(device):
        model = module.Qwen3_5ForCausalLM(config)
    return model.to(dtype)


def tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<pad>": 0, **{f"w{i}": i for i in range(1, vocab)}}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<pad>")


def rollouts(prompts: int, n: int, prompt_len: int, response_len: int, vocab: int, device: str) -> dict:
    """TRL's inputs for one micro-batch: prompt ids and mask, completion ids and mask, advantages."""
    gen = torch.Generator().manual_seed(1)
    prompt_ids, completion_ids, completion_mask = [], [], []
    for _ in range(prompts):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=gen)
        for i in range(n):
            prompt_ids.append(prompt)
            completion_ids.append(torch.randint(1, vocab, (response_len,), generator=gen))
            length = response_len - (i * response_len) // (2 * n)  # lengths vary: rows carry right padding
            completion_mask.append(torch.arange(response_len) < length)
    batch = {
        "prompt_ids": torch.stack(prompt_ids),
        "prompt_mask": torch.ones(prompts * n, prompt_len, dtype=torch.long),
        "completion_ids": torch.stack(completion_ids),
        "completion_mask": torch.stack(completion_mask).long(),
        "advantages": torch.randn(prompts * n, generator=gen),
    }
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    return {key: value.to(device) for key, value in batch.items()}


def trainer_for(arm: str, model, args, out_dir: str):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    model.config.shared_prefix_training = arm == "shared"
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=args.prompts * args.rollouts, num_generations=args.rollouts,
        max_completion_length=args.response_len, report_to="none", use_cpu=args.device == "cpu", bf16=False,
        gradient_checkpointing=args.checkpointing, save_strategy="no", disable_tqdm=True,
    )
    cls = GRPOTrainer if arm == "stock" else SharedPrefixGRPOTrainer
    data = Dataset.from_dict({"prompt": ["w1 w2"] * args.rollouts})
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
                  train_dataset=data, processing_class=tokenizer(model.config.vocab_size))
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def timed(fn, device: str, warmup: int, repeats: int) -> tuple[float, object]:
    result = None
    times = []
    for i in range(warmup + repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device != "cpu":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, result


def run_arm(arm: str, model, inputs: dict, args, plans: list) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = trainer_for(arm, model, args, out_dir)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        keep = inputs["completion_ids"].shape[1]

        def score():
            with torch.no_grad():
                return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)[0]

        def train_step():
            trainer.model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(trainer.model, dict(inputs))
            loss.backward()
            return loss.detach()

        if args.device != "cpu":
            torch.cuda.reset_peak_memory_stats()
        plans.clear()
        score_ms, logps = timed(score, args.device, args.warmup, args.repeats)
        train_ms, loss = timed(train_step, args.device, args.warmup, args.repeats)
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device != "cpu" else float("nan")
        compact = plans[-1].compact_length if plans else int(mask.sum())
    return dict(arm=arm, score_ms=score_ms, train_ms=train_ms, loss=loss.float().item(), peak_gib=peak,
                tokens_packed=int(mask.sum()), tokens_compact=compact, tokens_padded=mask.numel(),
                logps=logps.float())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="tiny")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=None, help="groups per micro-batch (4b: 1, tiny: 2)")
    parser.add_argument("--rollouts", type=int, default=None, help="completions per prompt (4b: 8, tiny: 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="4b: 2048, tiny: 256")
    parser.add_argument("--response-len", type=int, default=None, help="4b: 256, tiny: 32")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default=None, help="4b: bf16, tiny: fp32")
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checkpointing", action="store_true", help="TRL's gradient checkpointing (off by default)")
    parser.add_argument("--out", default=None, help="CSV path (default: print only)")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help="comma-separated arms in the order run (a short device call: the arm that matters first)")
    args = parser.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown or not args.arms:
        parser.error(f"--arms: unknown {unknown or 'empty'}; arms are {', '.join(ARMS)}")
    big = args.widths == "4b"
    args.prompts = args.prompts or (1 if big else 2)
    args.rollouts = args.rollouts or (8 if big else 4)
    args.prompt_len = args.prompt_len or (2048 if big else 256)
    args.response_len = args.response_len or (256 if big else 32)
    args.dtype = args.dtype or ("bfloat16" if big else "float32")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    from patchgen.kernels.modeling.shared_prefix import observe_plans

    plans = []
    model = build_model(args.widths, args.layers, getattr(torch, args.dtype), args.device)
    inputs = rollouts(args.prompts, args.rollouts, args.prompt_len, args.response_len, model.config.vocab_size,
                      args.device)
    with observe_plans(lambda plan, tokens: plans.append(plan) if plan is not None else None):
        rows = []
        for arm in args.arms:
            rows.append(run_arm(arm, model, inputs, args, plans))
            done = rows[-1]
            # printed as each arm ends: a device call that runs out of time still reports what it measured
            print(f"  [{arm}] scoring {done['score_ms']:.1f} ms, train step {done['train_ms']:.1f} ms, "
                  f"loss {done['loss']:.8f}, peak {done['peak_gib']:.2f} GiB, compact {done['tokens_compact']}",
                  flush=True)

    stock = next((row for row in rows if row["arm"] == "stock"), rows[0])
    shared = next((row for row in rows if row["arm"] == "shared"), rows[-1])
    device_name = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if args.device == "cpu" else ""
    print(f"GRPO through TRL: {args.prompts} x {args.rollouts} rollouts, prompt {args.prompt_len}, response <= "
          f"{args.response_len}; Qwen3.5 {args.widths} widths, {args.layers} layers, {args.dtype}, {device_name}; "
          f"median of {args.repeats}{load}")
    print(f"  tokens: padded {stock['tokens_padded']}, packed T {shared['tokens_packed']}, compact C "
          f"{shared['tokens_compact']}, T/C {shared['tokens_packed'] / shared['tokens_compact']:.2f}")
    versus = f"vs {stock['arm']} (score / train)"
    print(f"  {'arm':<7} {'scoring ms':>11} {'train step ms':>14} {versus:>26} {'peak GiB':>9} "
          f"{'loss':>14} {'max |logp - ' + stock['arm'] + '|':>19}")
    for row in rows:
        row["logp_diff"] = (row.pop("logps") - stock["logps"]).abs().max().item() if row is not stock else 0.0
    stock.pop("logps", None)
    for row in rows:
        speed = f"{stock['score_ms'] / row['score_ms']:.2f}x / {stock['train_ms'] / row['train_ms']:.2f}x"
        print(f"  {row['arm']:<7} {row['score_ms']:>11.1f} {row['train_ms']:>14.1f} {speed:>26} "
              f"{row['peak_gib']:>9.2f} {row['loss']:>14.8f} {row['logp_diff']:>19.2e}")
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(device=device_name, widths=args.widths, layers=args.layers, dtype=args.dtype,
                    prompts=args.prompts, rollouts=args.rollouts, prompt_len=args.prompt_len,
                    response_len=args.response_len, repeats=args.repeats, torch=torch.__version__)
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=[*meta, *rows[0]])
            writer.writeheader()
            for row in rows:
                writer.writerow({**meta, **{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()}})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
