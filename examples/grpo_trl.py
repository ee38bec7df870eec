"""GRPO with TRL on a tiny Qwen3.5, stock GRPOTrainer vs SharedPrefixGRPOTrainer: python examples/grpo_trl.py

Runs a few GRPO steps on the CPU (random weights, a word-level tokenizer made here, a toy reward:
the share of even word ids in a completion), first with stock ``trl.GRPOTrainer`` and the model's
``shared_prefix_training`` off, then with ``SharedPrefixGRPOTrainer`` and the flag on, from the same
seed. Prints the tokens scored per packed row (T) against the compact row (C), the time per step
and the losses, KL and rewards of both runs (same completions, same loss; the logged KL, a mean per micro-batch,
differs slightly after the first step because the micro-batches group whole prompts). The same model
generates the rollouts and trains on them; nothing is toggled between the two. By default the run
has what a real one has: a reference model (``--beta``), a sampling temperature other than 1 and
gradient accumulation over a generation batch that TRL shuffles (``steps_per_generation`` 2).

With a published checkpoint, load it through a generated class instead of building one here:

    from patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu import Qwen3_5ForCausalLM
    model = Qwen3_5ForCausalLM.from_pretrained("Qwen/Qwen3.5-0.8B", dtype=torch.bfloat16)
    model.config.shared_prefix_training = True
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

VOCAB = 256


def build_model(flag: bool):
    from patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
        eos_token_id=1, pad_token_id=0,
    )
    config.shared_prefix_training = flag  # share each prompt across its rollouts on packed training rows
    config.shared_prefix_min_length = 16  # prompts here are short; the default (64) suits real prompts
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).float()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    return model


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def prompts(count: int, length: int):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(0)
    rows = [" ".join(f"w{int(t)}" for t in torch.randint(2, VOCAB, (length,), generator=gen)) for _ in range(count)]
    return Dataset.from_dict({"prompt": rows})


def even_words(completions, **kwargs):
    """Toy reward: the share of words with an even id."""
    return [sum(int(w[1:]) % 2 == 0 for w in text.split()) / max(len(text.split()), 1) for text in completions]


def train(shared: bool, args) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=args.rollouts * 2, num_generations=args.rollouts,
            gradient_accumulation_steps=2, max_completion_length=args.completion_len, max_steps=args.steps,
            learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, seed=0, save_strategy="no",
            disable_tqdm=True, bf16=False, gradient_checkpointing=False, beta=args.beta, temperature=args.temperature,
        )
        model = build_model(shared)
        if args.beta:
            # Stock TRL loads the reference model from the policy's path (SharedPrefixGRPOTrainer then
            # replaces it by a patchgen copy holding those weights); a published checkpoint has its path already.
            model.save_pretrained(os.path.join(out_dir, "policy"))
            model.config._name_or_path = os.path.join(out_dir, "policy")
        cls = SharedPrefixGRPOTrainer if shared else GRPOTrainer
        trainer = cls(model=model, reward_funcs=even_words, args=config,
                      train_dataset=prompts(args.steps * 4, args.prompt_len), processing_class=tokenizer())
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = dict(seconds=elapsed / args.steps, logs=logs, step_time=[entry["step_time"] for entry in logs])
    if shared:
        result["tokens"] = trainer.shared_prefix_tokens
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--completion-len", type=int, default=24)
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no reference model)")
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    os.environ.setdefault("PATCHGEN_DEVICE_TARGET", "cpu")  # the torch backends, whatever the machine

    stock = train(False, args)
    ours = train(True, args)
    tokens = ours["tokens"]
    print(f"GRPO, tiny Qwen3.5 on the CPU: {args.steps} steps, 2 prompts x {args.rollouts} rollouts per micro-batch, "
          f"prompt {args.prompt_len} tokens, completions <= {args.completion_len}, beta {args.beta}, "
          f"temperature {args.temperature}")
    print(f"  tokens scored: packed T {tokens['packed']}, compact C {tokens['compact']}, "
          f"T/C {tokens['packed'] / max(tokens['compact'], 1):.2f}")
    print(f"  {'step':>4} {'stock loss':>12} {'shared loss':>12} {'stock kl':>10} {'shared kl':>10} {'reward':>8} "
          f"{'stock s':>8} {'shared s':>9}")
    for i, (a, b) in enumerate(zip(stock["logs"], ours["logs"]), 1):
        print(f"  {i:>4} {a['loss']:>12.6f} {b['loss']:>12.6f} {a.get('kl', 0.0):>10.3g} {b.get('kl', 0.0):>10.3g} "
              f"{b['reward']:>8.4f} {a['step_time']:>8.2f} {b['step_time']:>9.2f}")
    print(f"  wall time per step (generation included): stock {stock['seconds']:.2f} s, shared {ours['seconds']:.2f} s")


if __name__ == "__main__":
    main()
