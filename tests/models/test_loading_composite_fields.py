"""patchgen's fields set on a composite (vision-language) config reach the text model, whichever way it is built.

transformers builds a text class (``ForCausalLM``) from ``config.get_text_config()``, which dropped
fields set on the composite config itself; a text class loading a composite ``config.json`` keeps
only its text section. Every path below must end with the fields on the text config the model reads
and the op slots bound from them (``ops_implementation`` asks for sdpa where the environment says eager).
"""

import json

import pytest
import torch
from patchgen.kernels import ops
from patchgen.kernels.config import field
from patchgen.kernels.errors import SettingError
from patchgen.kernels.modeling.shared_prefix import observe_plans
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import patchgen
from patchgen.integrations import auto
from tests.models import checkpoints as ckpt
from tests.models import tiny

TARGETS = sorted(tiny.MODULES)
FIELDS = dict(shared_prefix_training=True, shared_prefix_verify=True, shared_prefix_min_length=8, shared_prefix_max_depth=1)
OPS = {"attention": "sdpa"}  # tests/models/conftest.py sets PATCHGEN_OPS_ATTENTION=eager


def composite(model: str, **fields):
    """The tiny VL config with ``fields`` (default: FIELDS and OPS) set on the composite config only."""
    config = ckpt.vl_config(model)
    for name, value in (fields or {**FIELDS, "ops_implementation": OPS}).items():
        setattr(config, name, value)
    return config


def assert_fields_reached(net, on_text_config: bool = True):
    config = net.config.get_text_config() if on_text_config else net.config
    for name, value in FIELDS.items():
        assert field(config, name) == value, name
    assert ops.of(net).backend("attention") == "sdpa"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """Per target model, a checkpoint saved by upstream's ForConditionalGeneration (the published layout)."""
    paths = {}
    for model in ("qwen3_5", "qwen3_5_moe"):
        paths[model] = tmp_path_factory.mktemp(model)
        ckpt.save_upstream(model, "ForConditionalGeneration", paths[model])
    return paths


@pytest.fixture
def registered():
    yield patchgen.register
    auto.unregister()


# ---- ForCausalLM (a text class) given the composite config -----------------------------------------


@pytest.mark.parametrize("model,device", TARGETS)
def test_auto_causal_lm_from_config_of_a_composite_keeps_its_fields(model, device, registered):
    registered(device)
    net = AutoModelForCausalLM.from_config(composite(model))
    assert type(net) is ckpt.generated_class(model, device, "ForCausalLM")
    assert_fields_reached(net)


@pytest.mark.parametrize("model,device", TARGETS)
def test_auto_causal_lm_from_pretrained_with_a_composite_config_keeps_its_fields_and_weights(model, device, registered, published):
    registered(device)
    net, info = AutoModelForCausalLM.from_pretrained(published[model], config=composite(model), output_loading_info=True)
    assert type(net) is ckpt.generated_class(model, device, "ForCausalLM")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_fields_reached(net)


@pytest.mark.parametrize("model,device", TARGETS)
def test_causal_lm_from_config_of_a_composite_keeps_its_fields(model, device):
    net = ckpt.generated_class(model, device, "ForCausalLM")._from_config(composite(model))
    assert_fields_reached(net)


@pytest.mark.parametrize("model,device", TARGETS)
def test_causal_lm_from_pretrained_with_a_composite_config_keeps_its_fields_and_weights(model, device, published):
    cls = ckpt.generated_class(model, device, "ForCausalLM")
    net, info = ckpt.load(cls, published[model], config=composite(model))
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_fields_reached(net)
    plain, _ = ckpt.load(cls, published[model], ops_implementation=OPS)  # the same kernels: attention runs its slot
    ids = ckpt.ids()
    assert torch.equal(net(ids).logits, plain(ids).logits)  # the same weights as the ordinary load


# ---- ForConditionalGeneration (holds the composite config) ------------------------------------------


@pytest.mark.parametrize("model,device", TARGETS)
def test_auto_image_text_to_text_from_config_and_from_pretrained_read_the_composite_fields(model, device, registered, published):
    registered(device)
    for net in (
        AutoModelForImageTextToText.from_config(composite(model)),
        AutoModelForImageTextToText.from_pretrained(published[model], config=composite(model)),
    ):
        assert type(net) is ckpt.generated_class(model, device, "ForConditionalGeneration")
        assert_fields_reached(net, on_text_config=False)


@pytest.mark.parametrize("model,device", TARGETS)
def test_conditional_generation_from_config_and_from_pretrained_read_the_composite_fields(model, device, published):
    cls = ckpt.generated_class(model, device, "ForConditionalGeneration")
    for net in (cls._from_config(composite(model)), cls.from_pretrained(published[model], config=composite(model))):
        assert_fields_reached(net, on_text_config=False)


# ---- a checkpoint saved with the fields on its composite config -------------------------------------


@pytest.fixture(scope="module")
def saved_with_fields(tmp_path_factory):
    """Per model, a generated ForConditionalGeneration saved with the fields set on its composite config."""
    paths = {}
    for model in ("qwen3_5", "qwen3_5_moe"):
        paths[model] = tmp_path_factory.mktemp(model + "_fields")
        torch.manual_seed(0)
        ckpt.generated_class(model, "gpu", "ForConditionalGeneration")(composite(model)).save_pretrained(paths[model])
        saved = json.loads((paths[model] / "config.json").read_text())
        assert saved["shared_prefix_training"] is True and "shared_prefix_training" not in saved["text_config"]
    return paths


@pytest.mark.parametrize("model,device", TARGETS)
def test_causal_lm_loading_a_composite_checkpoint_keeps_the_fields_saved_outside_its_text_section(model, device, saved_with_fields):
    net = ckpt.generated_class(model, device, "ForCausalLM").from_pretrained(saved_with_fields[model])
    assert_fields_reached(net)


@pytest.mark.parametrize("model,device", TARGETS)
def test_auto_causal_lm_loading_a_composite_checkpoint_keeps_the_fields_saved_outside_its_text_section(model, device, registered, saved_with_fields):
    registered(device)
    assert_fields_reached(AutoModelForCausalLM.from_pretrained(saved_with_fields[model]))


def test_a_keyword_field_wins_over_the_checkpoint_composite_value(saved_with_fields):
    net = ckpt.generated_class("qwen3_5", "gpu", "ForCausalLM").from_pretrained(
        saved_with_fields["qwen3_5"], shared_prefix_min_length=32
    )
    assert net.config.shared_prefix_min_length == 32 and net.config.shared_prefix_training is True


# ---- conflicts and the loader's lifetime -------------------------------------------------------------


def test_a_field_with_different_values_on_the_composite_and_its_text_config_is_refused(registered):
    registered("gpu")
    config = composite("qwen3_5", shared_prefix_training=True)
    config.text_config.shared_prefix_training = False
    with pytest.raises(SettingError, match="shared_prefix_training is True on the composite config and False on its text_config"):
        AutoModelForCausalLM.from_config(config)


def test_a_checkpoint_with_different_values_on_the_composite_and_its_text_section_is_refused(tmp_path):
    ckpt.save_upstream("qwen3_5", "ForConditionalGeneration", tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["shared_prefix_max_depth"], saved["text_config"]["shared_prefix_max_depth"] = 1, 2
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(SettingError, match="shared_prefix_max_depth is 1 on the composite config and 2 on its text_config"):
        ckpt.generated_class("qwen3_5", "gpu", "ForCausalLM").from_pretrained(tmp_path)


def test_unregister_drops_the_composite_loader_too(registered):
    registered("gpu")
    auto.unregister()
    net = AutoModelForCausalLM.from_config(composite("qwen3_5"))
    assert type(net) is ckpt.upstream_class("qwen3_5", "ForCausalLM")


@pytest.mark.parametrize("model,device", TARGETS)
def test_the_model_built_from_a_composite_config_shares_prefixes(model, device, registered):
    registered(device)
    net = AutoModelForCausalLM.from_config(composite(model, shared_prefix_training=True, shared_prefix_min_length=8)).double()
    ids, cu, _ = tiny.grpo_batch([(12, [3, 4])], seed=1)
    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        net(input_ids=ids, **tiny.packed_kwargs(cu))
    assert len(plans) == 1 and plans[0] is not None and plans[0].compact_length < ids.shape[1]


def test_a_load_whose_path_holds_no_config_file_reads_no_composite_fields(tmp_path):
    """A PEFT adapter folder has no config.json (transformers loads its base model's): nothing to read, no error."""
    from patchgen.kernels.modeling.fields import saved_composite_fields

    assert saved_composite_fields(ckpt.generated_class("qwen3_5", "gpu", "ForCausalLM"), (str(tmp_path),), {}) == {}
