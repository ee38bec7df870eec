"""A tiny word-level tokenizer, prompt data set and toy reward for trainer tests (no hub, CPU)."""

from __future__ import annotations

import torch

from tests.models import tiny

PAD, EOS = 0, 1


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, tiny.VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def prompts(count: int, length: int, seed: int = 0):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    rows = [" ".join(f"w{int(t)}" for t in torch.randint(2, tiny.VOCAB, (length,), generator=gen)) for _ in range(count)]
    return Dataset.from_dict({"prompt": rows})


def even_word_reward(completions, **kwargs):
    """Toy reward: the share of words with an even id (varies within a group, so advantages are non-zero)."""
    scores = []
    for text in completions:
        words = text.split()
        scores.append(sum(int(w[1:]) % 2 == 0 for w in words if w.startswith("w")) / max(len(words), 1))
    return scores


def model(flag: bool, seed: int = 0, module: str = "gpu", min_prefix: int = 4, family: str = "qwen3_5"):
    net = tiny.build(family, module, seed=seed, shared_prefix_training=flag, shared_prefix_min_length=min_prefix,
                     use_cache=True)
    net.config.eos_token_id, net.config.pad_token_id = EOS, PAD
    net.generation_config.eos_token_id, net.generation_config.pad_token_id = EOS, PAD
    return net


def train_observing_plans(trainer):
    """Train (printing nothing): (the trainer, its logged steps with a loss, the shared-prefix plans its forwards built)."""
    import contextlib
    import io

    from patchgen.kernels.modeling.shared_prefix import observe_plans

    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)), contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return trainer, [e for e in trainer.state.log_history if "loss" in e], [p for p in plans if p is not None]
