"""A text class loaded from the published (vision-language) layout saves that layout back, as upstream's does
(`model.language_model.*`). Trainer's resume loads such a checkpoint with ``load_state_dict(sd, strict=False)``,
which matched nothing but ``lm_head.weight``: the resumed model was the initial backbone under the trained head,
with only a logged warning (upstream's class still does this). The generated classes take the saved layout."""

import pytest
import torch
from safetensors.torch import load_file

from tests.models import checkpoints as ckpt


@pytest.mark.parametrize("name", ["ForCausalLM", "TextModel"])
@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_load_state_dict_of_a_checkpoint_saved_in_the_published_layout_restores_every_tensor(tmp_path, model, name):
    ckpt.save_upstream(model, "ForConditionalGeneration", tmp_path / "published")
    cls = ckpt.generated_class(model, "gpu", name)
    trained = cls.from_pretrained(tmp_path / "published")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    trained.save_pretrained(tmp_path / "checkpoint")
    saved = load_file(tmp_path / "checkpoint" / "model.safetensors")
    if name == "ForCausalLM":  # upstream's layout, kept on save (a TextModel saves its own keys)
        assert any(key.startswith("model.language_model.") for key in saved)

    resumed = cls.from_pretrained(tmp_path / "published")  # the script run again, then Trainer's resume:
    result = resumed.load_state_dict(saved, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    differing = [k for k, v in trained.state_dict().items() if not torch.equal(v, resumed.state_dict()[k])]
    assert not differing, differing[:3]


def test_keys_of_the_model_itself_load_as_before(tmp_path):
    cls = ckpt.generated_class("qwen3_5", "gpu", "ForCausalLM")
    torch.manual_seed(0)
    a, b = cls(ckpt.config_for("qwen3_5", "ForCausalLM")), cls(ckpt.config_for("qwen3_5", "ForCausalLM"))
    result = b.load_state_dict(a.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_a_model_built_from_its_config_takes_the_published_layout_too(tmp_path, model):
    # a Trainer built with `model_init`, or a script that builds the model and loads a state dict: not from_pretrained
    ckpt.save_upstream(model, "ForConditionalGeneration", tmp_path / "published")
    cls = ckpt.generated_class(model, "gpu", "ForCausalLM")
    trained = cls.from_pretrained(tmp_path / "published")
    trained.save_pretrained(tmp_path / "checkpoint")
    saved = load_file(tmp_path / "checkpoint" / "model.safetensors")
    assert all(key.startswith(("model.language_model.", "lm_head.")) for key in saved)
    built = cls(ckpt.config_for(model, "ForCausalLM"))
    result = built.load_state_dict(saved, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(v, built.state_dict()[k]) for k, v in trained.state_dict().items())
