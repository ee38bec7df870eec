"""``load_state_dict`` of a Qwen3.5-MoE checkpoint (one tensor per expert, as ``save_pretrained`` writes it)
fills the generated classes' fused experts exactly as ``from_pretrained`` does: a whole file, shard by shard
(``load_sharded_checkpoint``), and refusals naming the problem where it cannot."""

import json

import pytest
import torch
from patchgen.kernels.errors import ExpertWeightsUnloadable
from safetensors.torch import load_file
from transformers.trainer_utils import load_sharded_checkpoint

from tests.models import checkpoints as ckpt
from tests.models import tiny

DEVICES = ("gpu", "npu")
EXPERTS = "model.layers.0.mlp.experts."


def _build(device: str, layout: str, seed: int):
    torch.manual_seed(seed)
    net = ckpt.generated_class("qwen3_5_moe", device, layout)(ckpt.config_for("qwen3_5_moe", layout))
    tiny.randomize(net, seed)
    return net


def _saved(device, layout, path, **save_kwargs):
    net = _build(device, layout, seed=0)
    net.save_pretrained(path, **save_kwargs)
    return net


def _assert_same_tensors(net, expected):
    assert net.state_dict().keys() == expected.keys()
    differing = [name for name, tensor in net.state_dict().items() if not torch.equal(tensor, expected[name])]
    assert not differing, f"{len(differing)} differ, first {differing[:3]}"


@pytest.mark.parametrize("layout", ckpt.LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_load_state_dict_of_a_saved_checkpoint_equals_from_pretrained(device, layout, tmp_path):
    saved = _saved(device, layout, tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    assert f"{_prefix(layout)}0.gate_proj.weight" in checkpoint
    net = _build(device, layout, seed=1)
    report = net.load_state_dict(checkpoint, strict=True)
    assert report.missing_keys == [] and report.unexpected_keys == []
    _assert_same_tensors(net, saved.state_dict())
    _assert_same_tensors(net, type(net).from_pretrained(tmp_path).state_dict())


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_sharded_through_the_experts_loads_shard_by_shard(device, tmp_path):
    _saved(device, "ForCausalLM", tmp_path, max_shard_size="20KB")
    shards_of = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({file for key, file in shards_of.items() if key.startswith(EXPERTS)}) > 1  # one layer, several shards
    net = _build(device, "ForCausalLM", seed=1)
    load_sharded_checkpoint(net, tmp_path, strict=False)
    _assert_same_tensors(net, type(net).from_pretrained(tmp_path).state_dict())


def test_experts_absent_from_the_state_dict_stay_reported_missing(tmp_path):
    _saved("gpu", "ForCausalLM", tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    for source in ("gate_proj", "up_proj", "down_proj"):
        del checkpoint[f"{EXPERTS}5.{source}.weight"]
    net = _build("gpu", "ForCausalLM", seed=1)
    report = net.load_state_dict(checkpoint, strict=False)
    assert sorted(report.missing_keys) == [EXPERTS + "down_proj", EXPERTS + "gate_up_proj"]
    assert report.unexpected_keys == []
    experts = net.model.layers[0].mlp.experts
    gate, up = experts.gate_up_proj[0].chunk(2)
    assert torch.equal(gate, checkpoint[f"{EXPERTS}0.gate_proj.weight"])  # the experts present are loaded
    assert torch.equal(up, checkpoint[f"{EXPERTS}0.up_proj.weight"])
    assert torch.equal(experts.down_proj[4], checkpoint[f"{EXPERTS}4.down_proj.weight"])


def test_a_state_dict_holding_an_expert_both_fused_and_per_expert_is_refused(tmp_path):
    _saved("gpu", "ForCausalLM", tmp_path)
    net = _build("gpu", "ForCausalLM", seed=1)
    both = {**load_file(tmp_path / "model.safetensors"), **net.state_dict()}
    with pytest.raises(ExpertWeightsUnloadable, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj.*both fused and per expert"):
        net.load_state_dict(both, strict=False)


def test_an_expert_index_beyond_the_model_is_refused(tmp_path):
    _saved("gpu", "ForCausalLM", tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    checkpoint[f"{EXPERTS}6.down_proj.weight"] = checkpoint[f"{EXPERTS}0.down_proj.weight"]
    net = _build("gpu", "ForCausalLM", seed=1)
    with pytest.raises(ExpertWeightsUnloadable, match=r"expert indices \[6\] beyond the model's 6 experts"):
        net.load_state_dict(checkpoint, strict=False)


def test_an_expert_of_another_shape_is_refused(tmp_path):
    _saved("gpu", "ForCausalLM", tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    del checkpoint[f"{EXPERTS}5.up_proj.weight"]  # a partial set: written expert by expert
    checkpoint[f"{EXPERTS}0.up_proj.weight"] = checkpoint[f"{EXPERTS}0.up_proj.weight"][:, :-1]
    net = _build("gpu", "ForCausalLM", seed=1)
    with pytest.raises(ExpertWeightsUnloadable, match=r"expert 0's up_proj has shape \(16, 31\), the model's \(16, 32\)"):
        net.load_state_dict(checkpoint, strict=False)


def _prefix(layout: str) -> str:
    return EXPERTS if layout == "ForCausalLM" else EXPERTS.replace("model.", "model.language_model.", 1)
