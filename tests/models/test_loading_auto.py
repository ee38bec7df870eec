"""AutoModel classes build the generated classes: `patchgen.register(device)`, and checkpoints with `auto_map`."""

import json
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

import patchgen
from patchgen.integrations import auto
from tests.models import checkpoints as ckpt
from tests.models import tiny

TARGETS = sorted(tiny.MODULES)


@pytest.fixture
def registered():
    """Run the test with the auto classes registered, and leave them as upstream's afterwards."""
    yield patchgen.register
    auto.unregister()


def test_import_patchgen_stays_light():
    code = "import sys, patchgen; assert callable(patchgen.register); print(sorted({'torch', 'transformers', 'libcst'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


@pytest.mark.parametrize("model,device", TARGETS)
def test_register_makes_auto_classes_build_the_generated_classes(model, device, registered, tmp_path):
    registered(device)
    for layout, auto_cls, name in [
        ("ForCausalLM", AutoModelForCausalLM, "ForCausalLM"),
        ("ForConditionalGeneration", AutoModelForCausalLM, "ForCausalLM"),  # the published layout
        ("ForConditionalGeneration", AutoModelForImageTextToText, "ForConditionalGeneration"),
        ("ForConditionalGeneration", AutoModel, "Model"),
    ]:
        path = tmp_path / layout
        if not path.exists():
            ckpt.save_upstream(model, layout, path)
        net, info = auto_cls.from_pretrained(path, output_loading_info=True)
        assert type(net) is ckpt.generated_class(model, device, name), (layout, auto_cls.__name__)
        if name != "Model":
            assert not info["missing_keys"] and not info["unexpected_keys"]


def test_register_replaces_the_other_device_and_unregister_restores_upstream(registered, tmp_path):
    ckpt.save_upstream("qwen3_5", "ForCausalLM", tmp_path)
    registered("gpu")
    registered("npu")
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is ckpt.generated_class("qwen3_5", "npu", "ForCausalLM")
    auto.unregister()
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is ckpt.upstream_class("qwen3_5", "ForCausalLM")


def test_register_names_what_it_registered(registered):
    table = registered("gpu")
    assert table["AutoModelForCausalLM"]["qwen3_5"].endswith("patched_modeling_qwen3_5_gpu.Qwen3_5ForCausalLM")
    assert table["AutoModelForImageTextToText"]["qwen3_5_moe"].endswith("moe_gpu.Qwen3_5MoeForConditionalGeneration")


def test_register_refuses_an_unknown_device():
    with pytest.raises(ValueError, match="device must be one of"):
        patchgen.register("tpu")


@pytest.mark.parametrize("model,device", TARGETS)
def test_checkpoint_with_auto_map_loads_the_generated_code_it_carries(model, device, tmp_path, monkeypatch):
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    cls = ckpt.generated_class(model, device, "ForCausalLM")
    monkeypatch.setattr(cls, "_auto_class", None)  # register_for_auto_class marks the class itself
    upstream = ckpt.save_upstream(model, "ForCausalLM", tmp_path / "upstream")
    ours = cls.from_pretrained(tmp_path / "upstream")
    ours.register_for_auto_class("AutoModelForCausalLM")
    ours.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    module_name = cls.__module__.rpartition(".")[2]
    assert config["auto_map"] == {"AutoModelForCausalLM": f"{module_name}.{cls.__name__}"}
    assert (tmp_path / "ckpt" / f"{module_name}.py").exists()

    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True, output_loading_info=True)
    assert type(loaded).__name__ == cls.__name__ and type(loaded).__module__.startswith("transformers_modules.")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = ckpt.ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, upstream.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_while_registered_upstreams_composite_builds_the_generated_text_model(registered):
    # Documented in docs/loading.md: upstream's Qwen3_5Model builds its language model with AutoModel.
    registered("gpu")
    upstream = ckpt.upstream_class("qwen3_5", "ForConditionalGeneration")(ckpt.vl_config("qwen3_5"))
    assert type(upstream.model.language_model) is ckpt.generated_class("qwen3_5", "gpu", "TextModel")
    auto.unregister()
    upstream = ckpt.upstream_class("qwen3_5", "ForConditionalGeneration")(ckpt.vl_config("qwen3_5"))
    assert type(upstream.model.language_model) is ckpt.upstream_class("qwen3_5", "TextModel")
