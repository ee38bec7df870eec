"""patchgen's config fields as from_pretrained keywords, as transformers takes any config field."""

import pytest
from patchgen.kernels import ops
from patchgen.kernels.errors import SettingError
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import patchgen
from patchgen.integrations import auto
from tests.models import checkpoints as ckpt


@pytest.fixture
def published(tmp_path):
    """A checkpoint saved by upstream's ForConditionalGeneration (the published layout), auto classes registered."""
    ckpt.save_upstream("qwen3_5", "ForConditionalGeneration", tmp_path)
    patchgen.register("gpu")
    yield tmp_path
    auto.unregister()


@pytest.mark.parametrize("auto_cls", [AutoModelForCausalLM, AutoModelForImageTextToText])
def test_shared_prefix_fields_given_to_from_pretrained_land_on_the_text_config(published, auto_cls):
    net = auto_cls.from_pretrained(published, shared_prefix_training=True, shared_prefix_min_length=16)
    text = net.config.get_text_config()
    assert text.shared_prefix_training is True and text.shared_prefix_min_length == 16


def test_ops_implementation_given_to_from_pretrained_selects_the_backend(published):
    net = ckpt.generated_class("qwen3_5", "gpu", "ForCausalLM").from_pretrained(
        published, ops_implementation={"attention": "sdpa"}  # the environment (conftest) says eager
    )
    assert ops.of(net).backend("attention") == "sdpa"


def test_an_ops_implementation_config_object_is_saved_and_loaded_back(published, tmp_path):
    """docs/kernel_selection.md allows a dict or an OpsImplementationConfig; either must survive save_pretrained
    (a Trainer's checkpoint save), which writes the config as JSON."""
    from patchgen.kernels.config import OpsImplementationConfig

    cls = ckpt.generated_class("qwen3_5", "gpu", "ForCausalLM")
    net = cls.from_pretrained(published, ops_implementation=OpsImplementationConfig(attention="sdpa"))
    net.save_pretrained(tmp_path / "saved")
    back = cls.from_pretrained(tmp_path / "saved")
    assert ops.of(back).backend("attention") == "sdpa"


def test_from_pretrained_with_loading_info_takes_the_fields_too(published):
    net, info = AutoModelForCausalLM.from_pretrained(published, shared_prefix_verify=True, output_loading_info=True)
    assert net.config.shared_prefix_verify is True and not info["missing_keys"]


def test_an_ill_valued_field_given_to_from_pretrained_is_a_setting_error(published):
    with pytest.raises(SettingError, match="shared_prefix_training must be True or False"):
        AutoModelForCausalLM.from_pretrained(published, shared_prefix_training="yes")


def test_a_field_misspelt_in_from_pretrained_is_named_with_the_field_meant(published):
    with pytest.raises(SettingError, match="'shared_prefix_trainig' is not one patchgen reads; did you mean 'shared_prefix_training'"):
        ckpt.generated_class("qwen3_5", "gpu", "ForCausalLM").from_pretrained(published, shared_prefix_trainig=True)
