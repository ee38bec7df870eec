"""The user's flow: load a checkpoint upstream's own class saved, train it with HF ``Trainer`` on packed
rows with shared prefixes (gradient checkpointing on; the trainer leaves the model in training mode),
then ``generate`` with the same model object. Greedy tokens equal those of upstream's class loaded
from the trained weights, for a left-padded batch, with and without a cache. The gpu module on the
CPU with the backends it selects there by itself (no PATCHGEN_* settings)."""

import contextlib
import io

import pytest
import torch

from tests.models import checkpoints as ckpt
from tests.models import tiny

PAD = 0


@pytest.fixture
def user_defaults(monkeypatch):
    """What a user on a CPU machine gets: no target or backend set, each slot's own choice."""
    import os

    from patchgen.kernels import ops

    for variable in [v for v in os.environ if v.startswith("PATCHGEN_")]:
        monkeypatch.delenv(variable)
    ops.reset_default()
    yield
    ops.reset_default()


def _rows(seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, tiny.VOCAB, (70,), generator=gen).tolist()
    return [prompt + torch.randint(2, tiny.VOCAB, (n,), generator=gen).tolist() for n in (3, 1, 6, 2)]


def _train(net, tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=0.5, optim="sgd",
        report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
        gradient_checkpointing=True,
    )
    trainer = Trainer(model=net, args=args, train_dataset=Dataset.from_dict({"input_ids": _rows()}),
                      data_collator=DataCollatorWithFlattening(return_tensors="pt"))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()


def _generate(net, use_cache):
    ids, mask = tiny.left_padded_batch((5, 24, 9), pad=PAD)
    out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=use_cache,
                       eos_token_id=None, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_generation_after_training_equals_upstream_from_the_trained_weights(user_defaults, model, tmp_path):
    from patchgen.kernels.modeling.shared_prefix import observe_plans

    ckpt.save_upstream(model, "ForConditionalGeneration", tmp_path / "published")
    net = ckpt.generated_class(model, "gpu", "ForCausalLM").from_pretrained(
        tmp_path / "published", dtype=torch.float64, shared_prefix_training=True, shared_prefix_min_length=8
    )
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        _train(net, tmp_path / "run")
    assert plans and all(p is not None for p in plans)
    assert any(not torch.equal(p, before[name]) for name, p in net.named_parameters())
    assert net.training and net.is_gradient_checkpointing  # as the trainer leaves it
    net.save_pretrained(tmp_path / "trained")
    extra = {"experts_implementation": "eager"} if model == "qwen3_5_moe" else {}
    upstream = ckpt.upstream_class(model, "ForCausalLM").from_pretrained(
        tmp_path / "trained", dtype=torch.float64, **extra
    ).eval()
    upstream.config.output_router_logits = False  # upstream's MoE generate fails on a padding mask with it on
    expected, expected_logits = _generate(upstream, use_cache=True)
    for use_cache in (True, False):
        tokens, logits = _generate(net, use_cache)
        assert torch.equal(tokens, expected)
        # upstream rounds its norms, decay and delta rule to float32 inside a float64 model
        torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)
