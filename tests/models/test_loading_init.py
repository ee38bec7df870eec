"""A fresh generated model is initialised exactly as upstream's with the same seed."""

import pytest
import torch

from tests.models import checkpoints as ckpt
from tests.models import tiny

TARGETS = sorted(tiny.MODULES)


@pytest.mark.parametrize("layout", ckpt.LAYOUTS)
@pytest.mark.parametrize("model,device", TARGETS)
def test_fresh_model_equals_upstreams_with_the_same_seed(model, device, layout):
    nets = []
    for cls in (ckpt.generated_class(model, device, layout), ckpt.upstream_class(model, layout)):
        torch.manual_seed(7)
        nets.append(cls(ckpt.config_for(model, layout)))
    ours, theirs = (net.state_dict() for net in nets)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("device", ["gpu", "npu"], ids=["gpu-target", "npu-target"])
def test_fresh_moe_routers_are_initialised_not_zero(device):
    torch.manual_seed(0)
    net = ckpt.generated_class("qwen3_5_moe", device, "ForCausalLM")(tiny.text_config("qwen3_5_moe"))
    for layer in net.model.layers:
        std = layer.mlp.gate.weight.std().item()
        assert abs(std - net.config.initializer_range) < 0.01, std


@pytest.mark.parametrize("model,device", TARGETS)
def test_from_config_and_from_pretrained_classes_count_as_upstream_code_but_subclasses_do_not(model, device):
    cls = ckpt.generated_class(model, device, "ForCausalLM")
    assert not cls.is_custom_code()

    class Mine(cls):
        pass

    assert Mine.is_custom_code()
