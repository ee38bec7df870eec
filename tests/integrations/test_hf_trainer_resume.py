"""HF ``Trainer`` resuming a tiny Qwen3.5-MoE from its own checkpoint restores every weight, experts included.

The checkpoint holds one tensor per expert (as ``save_pretrained`` writes it); Trainer's resume loads it with
``model.load_state_dict(..., strict=False)``, which upstream's class leaves unconverted: its experts keep
the weights they had before the resume, with only a logged warning. The other loading paths (both targets, the composite class, sharded checkpoints)
are in tests/models/test_loading_state_dict.py."""

import contextlib
import io

import torch

from tests.integrations import tiny_trl
from tests.models import tiny


def _trainer(net, out_dir, **extra):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    rows = torch.randint(2, tiny.VOCAB, (4, 12), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": rows, "labels": rows})
    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=4, max_steps=1, learning_rate=0.1, optim="sgd",
        report_to="none", use_cpu=True, seed=0, disable_tqdm=True, **extra,
    )
    return Trainer(model=net, args=args, train_dataset=data)


def _assert_same_weights(net, expected, what):
    assert net.state_dict().keys() == expected.keys()
    differing = [name for name, tensor in net.state_dict().items() if not torch.equal(tensor, expected[name])]
    assert not differing, f"{len(differing)} tensors differ from {what}, first {differing[:3]}"


def test_resuming_restores_every_weight_of_the_checkpoint(tmp_path, device="gpu"):
    trained = tiny_trl.model(False, family="qwen3_5_moe", module=device)
    with contextlib.redirect_stdout(io.StringIO()):
        _trainer(trained, tmp_path, save_strategy="steps", save_steps=1).train()
    checkpoint = tmp_path / "checkpoint-1"
    assert any(".experts.0.gate_proj." in key for key in _saved_keys(checkpoint))  # the per-expert layout
    saved = {name: tensor.clone() for name, tensor in trained.state_dict().items()}

    # another seed: every weight, each expert included, starts away from the checkpoint
    resumed = tiny_trl.model(False, seed=1, family="qwen3_5_moe", module=device)
    assert not torch.equal(resumed.model.layers[0].mlp.experts.down_proj, saved["model.layers.0.mlp.experts.down_proj"])
    with contextlib.redirect_stdout(io.StringIO()):
        _trainer(resumed, tmp_path / "resumed", save_strategy="no").train(resume_from_checkpoint=str(checkpoint))

    _assert_same_weights(resumed, saved, "the checkpointed model")
    loaded = type(resumed).from_pretrained(checkpoint, dtype="auto")
    _assert_same_weights(resumed, loaded.state_dict(), "from_pretrained of the checkpoint")


def _saved_keys(checkpoint):
    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", "pt") as handle:
        return list(handle.keys())
