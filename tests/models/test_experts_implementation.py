"""transformers' experts_implementation keeps its meaning: it picks the kernel of the moe_experts op slot."""

import pytest
import torch
from patchgen.kernels import ops
from patchgen.kernels.errors import BackendUnavailable

from tests.models import checkpoints as ckpt
from tests.models import tiny

DEVICES = pytest.mark.parametrize("device", ["gpu", "npu"], ids=["gpu-target", "npu-target"])


@pytest.fixture(autouse=True)
def _no_experts_env(monkeypatch):
    # tests/models/conftest.py pins the slot through the environment; these tests are about the config.
    monkeypatch.delenv("PATCHGEN_OPS_MOE_EXPERTS", raising=False)


def _build(device, layout="ForCausalLM", **config_extra):
    config = ckpt.config_for("qwen3_5_moe", layout)
    for key, value in config_extra.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return tiny.randomize(ckpt.generated_class("qwen3_5_moe", device, layout)(config))


def _experts_backend(net):
    return ops.of(net.get_decoder().layers[0].mlp.experts).backend("moe_experts")


@DEVICES
def test_unset_leaves_the_choice_to_the_op_slot(device):
    net = _build(device)
    assert net.config._experts_implementation is None
    assert ops.of(net).choices["moe_experts"].why.startswith(("device default", "auto"))


@DEVICES
@pytest.mark.parametrize("name", ["eager", "batched_mm", "grouped_mm"])
def test_from_pretrained_experts_implementation_picks_the_slot_backend(device, name, tmp_path):
    _build(device).save_pretrained(tmp_path)
    cls = ckpt.generated_class("qwen3_5_moe", device, "ForCausalLM")
    net = cls.from_pretrained(tmp_path, experts_implementation=name)
    assert net.config._experts_implementation == name
    assert _experts_backend(net) == name
    assert ops.of(net).choices["moe_experts"].why == f"config experts_implementation={name!r}"


@DEVICES
def test_set_experts_implementation_switches_the_kernel_and_keeps_the_logits(device):
    net = _build(device).eval()
    ids = ckpt.ids()
    with torch.no_grad():
        net.set_experts_implementation("eager")
        assert _experts_backend(net) == "eager"
        eager = net(input_ids=ids).logits
        net.set_experts_implementation("batched_mm")
        assert _experts_backend(net) == "batched_mm" and net.config._experts_implementation == "batched_mm"
        torch.testing.assert_close(net(input_ids=ids).logits, eager, rtol=1e-5, atol=1e-6)


@DEVICES
def test_set_experts_implementation_reaches_the_text_model_of_the_vision_language_model(device):
    net = _build(device, "ForConditionalGeneration")
    net.set_experts_implementation("batched_mm")
    assert _experts_backend(net) == "batched_mm"
    assert net.get_experts_implementation()[""] == "batched_mm"


@DEVICES
def test_experts_implementation_beats_the_environment(device, monkeypatch):
    monkeypatch.setenv("PATCHGEN_OPS_MOE_EXPERTS", "grouped_mm")
    assert _experts_backend(_build(device, _experts_implementation="eager")) == "eager"
    assert _experts_backend(_build(device)) == "grouped_mm"


@DEVICES
def test_ops_implementation_and_experts_implementation_must_agree(device):
    agree = _build(device, ops_implementation={"moe_experts": "eager"}, _experts_implementation="eager")
    assert _experts_backend(agree) == "eager"
    with pytest.raises(ValueError, match="moe_experts asked twice"):
        _build(device, ops_implementation={"moe_experts": "grouped_mm"}, _experts_implementation="eager")


@DEVICES
def test_an_experts_implementation_without_a_backend_is_refused(device):
    net = _build(device)
    with pytest.raises(BackendUnavailable, match="experts_implementation='sonicmoe' has no moe_experts backend"):
        net.set_experts_implementation("sonicmoe")


def test_dense_model_accepts_eager_and_refuses_grouped_mm_as_upstream():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM as Upstream

    for cls in (ckpt.generated_class("qwen3_5", "gpu", "ForCausalLM"), Upstream):
        net = cls(tiny.text_config("qwen3_5"))
        net.set_experts_implementation("eager")
        assert net.config._experts_implementation == "eager"
        with pytest.raises(ValueError, match="does not support setting experts implementation"):
            net.set_experts_implementation("grouped_mm")


@DEVICES
@pytest.mark.parametrize("name", ["batched_mm", "grouped_mm"])
def test_a_replaced_transformers_experts_function_is_refused_not_ignored(device, name):
    # Upstream would call whatever ALL_EXPERTS_FUNCTIONS holds under the name; ours runs its own backend.
    from unittest import mock

    from transformers.integrations import moe

    net = _build(device)
    replacement = mock.Mock(wraps=moe.ALL_EXPERTS_FUNCTIONS[name])
    replaced = mock.patch.dict(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, {name: replacement})
    with replaced, pytest.raises(BackendUnavailable, match=rf"ALL_EXPERTS_FUNCTIONS\['{name}'\] is"):
        net.set_experts_implementation(name)
    net.set_experts_implementation(name)
    assert _experts_backend(net) == name
