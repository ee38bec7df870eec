"""Packed rows from the real collators: transformers' DataCollatorWithFlattening and TRL's SFT padding_free.

Both give rows whose sequences are marked by restarting position_ids (the flattening collator gives
nothing else unless asked); a run on them must equal the same run on padded batches.
"""

import numpy as np
import pytest
import torch

from tests.integrations import tiny_trl
from tests.models import tiny


def _sequences(count=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 30, (count,), generator=gen).tolist()
    return [torch.randint(2, tiny.VOCAB, (n,), generator=gen).tolist() for n in lengths]


COLLATOR_OUTPUTS = {
    "position_ids": {},
    "flash_kwargs": {"return_flash_attn_kwargs": True},
    "seq_idx_and_positions": {"return_seq_idx": True},
    "seq_idx_alone": {"return_seq_idx": True, "return_position_ids": False},  # sequence indices only
    "flash_kwargs_and_seq_idx": {"return_flash_attn_kwargs": True, "return_seq_idx": True},  # checked against each other
}


@pytest.mark.parametrize("options", COLLATOR_OUTPUTS.values(), ids=COLLATOR_OUTPUTS.keys())
def test_flattening_collator_row_equals_each_sequence_alone(options):
    from transformers import DataCollatorWithFlattening

    net = tiny_trl.model(False)
    seqs = _sequences(4)
    batch = DataCollatorWithFlattening(return_tensors="pt", **options)([{"input_ids": s} for s in seqs])
    assert ("cu_seq_lens_q" in batch) == options.get("return_flash_attn_kwargs", False)
    out = net(**batch)
    nll, count = 0.0, 0
    for s in seqs:
        ids = torch.tensor([s])
        alone = net(input_ids=ids).logits
        nll = nll + torch.nn.functional.cross_entropy(alone[0, :-1], ids[0, 1:], reduction="sum")
        count += len(s) - 1
    assert torch.allclose(out.loss, nll / count, atol=1e-12, rtol=0)


def _padded(features):
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), longest), tiny_trl.PAD)
    labels = torch.full((len(features), longest), -100)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        labels[i, :n] = torch.tensor(f["input_ids"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _hf_run(collator, tmp_path, flag=False, sequences=None, **extra):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    net = tiny_trl.model(flag)
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=0.1, optim="sgd",
        logging_steps=1, report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
        remove_unused_columns=False,
    )
    args = TrainingArguments(**{**settings, **extra})
    data = Dataset.from_dict({"input_ids": sequences or _sequences(8)})
    trainer = Trainer(model=net, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e], net


def test_hf_trainer_with_the_flattening_collator_equals_padded_batches(tmp_path):
    from transformers import DataCollatorWithFlattening

    flat, net_flat = _hf_run(DataCollatorWithFlattening(return_tensors="pt"), tmp_path / "flat")
    padded, net_padded = _hf_run(_padded, tmp_path / "padded")
    for a, b in zip(flat, padded):
        # Trainer accumulates the logged loss in a float32 tensor.
        assert a["loss"] == pytest.approx(b["loss"], rel=4 * torch.finfo(torch.float32).eps)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-9)
    padded_weights = dict(net_padded.named_parameters())
    for name, p in net_flat.named_parameters():
        assert torch.allclose(p, padded_weights[name], atol=1e-10, rtol=0), name


def _sft_run(padding_free, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    net = tiny_trl.model(False)
    text = [" ".join(f"w{t}" for t in s) for s in _sequences(8)]
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=0.1, optim="sgd",
        logging_steps=1, report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
        padding_free=padding_free, bf16=False, max_length=None,
    )
    trainer = SFTTrainer(model=net, args=args, train_dataset=Dataset.from_dict({"text": text}),
                         processing_class=tiny_trl.tokenizer())
    trainer.train()
    return [e for e in trainer.state.log_history if "loss" in e], net


def test_trl_sft_padding_free_equals_padded_sft(tmp_path):
    free, net_free = _sft_run(True, tmp_path / "free")
    padded, net_padded = _sft_run(False, tmp_path / "padded")
    assert len(free) == len(padded) == 2
    for a, b in zip(free, padded):
        # TRL's fused LM head accumulates its log-sum-exp in float32, whatever the model's dtype.
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    padded_weights = dict(net_padded.named_parameters())
    for name, p in net_free.named_parameters():
        assert torch.allclose(p, padded_weights[name], atol=1e-7, rtol=0), name


def _grouped_sequences(groups=4, rollouts=3, prompt=20, seed=0):
    """Prompt + response sequences, `rollouts` per prompt (what shared prefixes are for)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(groups):
        head = torch.randint(2, tiny.VOCAB, (prompt,), generator=gen).tolist()
        for _ in range(rollouts):
            length = int(torch.randint(3, 10, (1,), generator=gen))
            seqs.append(head + torch.randint(2, tiny.VOCAB, (length,), generator=gen).tolist())
    return seqs


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_hf_trainer_with_the_flattening_collator_shares_prefixes_and_equals_the_flag_off(tmp_path, flash_kwargs):
    """Gradient accumulation over two flattened micro-batches of two groups each; the flag on vs off."""
    from patchgen.kernels.modeling.shared_prefix import observe_plans
    from transformers import DataCollatorWithFlattening

    def run(flag):
        collator = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=flash_kwargs)
        return _hf_run(collator, tmp_path / str(flag), flag=flag, sequences=_grouped_sequences(),
                       per_device_train_batch_size=6, gradient_accumulation_steps=2)

    plans = []
    off, net_off = run(False)
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        on, net_on = run(True)
    assert len(plans) == 4 and all(p is not None and p.compact_length < p.packed_length for p in plans)
    for a, b in zip(on, off):
        assert a["loss"] == pytest.approx(b["loss"], rel=4 * torch.finfo(torch.float32).eps)  # logged through float32
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-9)
    weights_off = dict(net_off.named_parameters())
    for name, p in net_on.named_parameters():
        assert torch.allclose(p, weights_off[name], atol=1e-10, rtol=0), name


def test_trl_sft_padding_free_with_the_flag_on_warns_that_nothing_is_shared(tmp_path):
    """TRL's SFTTrainer calls the backbone through its own LM head: the plan is never built, and the model says so."""
    from datasets import Dataset
    from patchgen.kernels.modeling.shared_prefix import SharedPrefixUnused
    from trl import SFTConfig, SFTTrainer

    text = [" ".join(f"w{t}" for t in s) for s in _grouped_sequences()]
    args = SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=6, max_steps=1, learning_rate=0.1, optim="sgd",
        report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, padding_free=True, bf16=False,
        max_length=None,
    )
    trainer = SFTTrainer(model=tiny_trl.model(True), args=args, train_dataset=Dataset.from_dict({"text": text}),
                         processing_class=tiny_trl.tokenizer())
    with pytest.warns(SharedPrefixUnused, match="through its own LM head"):
        trainer.train()


def test_hf_trainer_flag_on_with_accumulation_evaluation_and_prediction_equals_upstreams_class_on_padded_batches(
    tmp_path, monkeypatch
):
    """The whole Trainer flow a user runs on rollouts sharing prompts: gradient accumulation (the loss normalised by
    Trainer's num_items_in_batch over micro-batches of unequal token counts), evaluate() before and after training,
    and predict(), flag on with the flattening collator against transformers' own class on padded batches."""
    import contextlib
    import io

    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    def run(net, collator, out):
        args = TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=3, gradient_accumulation_steps=2,
            max_steps=3, learning_rate=0.1, optim="sgd", logging_steps=1, report_to="none", use_cpu=True, seed=0,
            save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
        )
        trainer = Trainer(
            model=net, args=args, data_collator=collator,
            train_dataset=Dataset.from_dict({"input_ids": _grouped_sequences(groups=4, rollouts=3)}),
            eval_dataset=Dataset.from_dict({"input_ids": _grouped_sequences(groups=2, rollouts=3, seed=3)}),
        )
        with contextlib.redirect_stdout(io.StringIO()):
            before = trainer.evaluate()["eval_loss"]
            predicted = trainer.predict(trainer.eval_dataset)  # before training: the weights are equal to float64's
            trainer.train()
            after = trainer.evaluate()["eval_loss"]
        return [e for e in trainer.state.log_history if "loss" in e], (before, after), predicted.predictions, net

    ours = tiny_trl.model(True)
    upstream = tiny.upstream_model("qwen3_5", monkeypatch, ours.state_dict())
    logs_a, evals_a, logits_a, net_a = run(upstream, _padded, tmp_path / "upstream")
    logs_b, evals_b, logits_b, net_b = run(ours, DataCollatorWithFlattening(return_tensors="pt"), tmp_path / "ours")
    assert len(logs_a) == len(logs_b) == 3
    # upstream's loss casts the logits to float32 (ForCausalLMLoss), so losses and gradients agree to float32 rounding
    for a, b in zip(logs_a, logs_b):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    assert evals_a == pytest.approx(evals_b, rel=1e-6)
    weights = dict(net_a.named_parameters())
    for name, p in net_b.named_parameters():
        assert torch.allclose(p, weights[name], atol=1e-8, rtol=0), name
    # predictions: [sequences, longest, vocab] padded against one flattened row per eval batch of three sequences
    lengths = [len(s) for s in _grouped_sequences(groups=2, rollouts=3, seed=3)]
    for i, n in enumerate(lengths):
        row, start = divmod(i, 3)
        offset = sum(lengths[row * 3 : row * 3 + start])
        assert np.allclose(logits_b[row, offset : offset + n], logits_a[i, :n], atol=1e-10, rtol=0), i
