"""Misspelt or ill-valued patchgen settings are errors naming the setting as the user wrote it (issue 14, item 6)."""

import re
import typing

import pytest
from patchgen.kernels import ops, registry
from patchgen.kernels.config import check_environment, check_model_config, shared_prefix_min_length
from patchgen.kernels.errors import BackendUnavailable, SettingError
from patchgen.kernels.selection import resolve
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for slot in registry.SLOTS:
        monkeypatch.delenv(f"PATCHGEN_OPS_{slot.upper()}", raising=False)


def test_misspelt_slot_variable_is_an_error_naming_the_close_match(monkeypatch):
    monkeypatch.setenv("PATCHGEN_OPS_ATTENTON", "eager")
    with pytest.raises(SettingError, match=r"PATCHGEN_OPS_ATTENTON='eager' names no op slot \(did you mean PATCHGEN_OPS_ATTENTION\?\)"):
        resolve(None, "cpu")


def test_singular_prefix_is_caught_too(monkeypatch):
    monkeypatch.setenv("PATCHGEN_OP_GATED_DELTA_RULE", "torch")
    with pytest.raises(SettingError, match="did you mean PATCHGEN_OPS_GATED_DELTA_RULE"):
        check_environment()


def test_every_slot_variable_is_accepted():
    check_environment({f"PATCHGEN_OPS_{slot.upper()}": "auto" for slot in registry.SLOTS})


def test_misspelt_backend_name_suggests_the_close_match():
    with pytest.raises(BackendUnavailable, match="did you mean 'eager'"):
        resolve({"attention": "eagre"}, "cpu")


def test_misspelt_slot_in_ops_implementation_suggests_the_close_match():
    with pytest.raises(SettingError, match=r"\['atention'\] \(did you mean attention\?\)"):
        resolve({"atention": "eager"}, "cpu")


@pytest.mark.parametrize("value", [0, -3, 2.5, "64", True])
def test_bad_min_length_names_the_config_field(value):
    config = Qwen3_5TextConfig(shared_prefix_min_length=value)
    with pytest.raises(SettingError, match="config field shared_prefix_min_length must be a whole number"):
        shared_prefix_min_length(config)


def test_min_length_defaults_to_64():
    assert shared_prefix_min_length(Qwen3_5TextConfig()) == 64


def test_non_boolean_training_flag_is_an_error():
    with pytest.raises(SettingError, match="shared_prefix_training must be True or False, got 'yes'"):
        check_model_config(Qwen3_5TextConfig(shared_prefix_training="yes"))


def test_field_one_typo_away_from_ours_is_an_error():
    with pytest.raises(SettingError, match="'shared_prefix_trainig' is not one patchgen reads; did you mean 'shared_prefix_training'"):
        check_model_config(Qwen3_5TextConfig(shared_prefix_trainig=True))


def test_typo_in_a_text_config_is_caught_from_the_outer_config():
    config = Qwen3_5Config(text_config={"shared_prefix_min_lenght": 32})
    with pytest.raises(SettingError, match="did you mean 'shared_prefix_min_length'"):
        check_model_config(config)


@pytest.mark.parametrize("cls", [Qwen3_5Config, Qwen3_5TextConfig, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig])
def test_upstream_configs_pass_untouched(cls):
    check_model_config(cls(shared_prefix_training=True, shared_prefix_min_length=8))


def test_bind_checks_the_model_config():
    import torch

    net = torch.nn.Linear(2, 2)
    net.config = Qwen3_5TextConfig(shared_prefix_min_length=0)
    with pytest.raises(SettingError, match="shared_prefix_min_length"):
        ops.bind(net, device_target="cpu")


@pytest.mark.parametrize("name", ["shared_prefix_training", "shared_prefix_verify", "shared_prefix_chunk_aligned"])
def test_a_flag_set_after_the_build_to_a_string_is_refused_not_read_as_true(name):
    """`model.config.<flag> = "false"` after the build skips the build's check; the forward reads it checked."""
    from tests.models import tiny

    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    setattr(net.config, name, "false")
    ids, cu, _ = tiny.grpo_batch([(70, [5, 9, 3])], seed=1)
    with pytest.raises(SettingError, match=f"config field {name} must be True or False, got 'false'"):
        net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))


@pytest.mark.parametrize(("variable", "meant"), [
    ("PATCHGEN_SHARED_PREFIX_LEVELCOST", "did you mean PATCHGEN_SHARED_PREFIX_LEVEL_COST?"),
    ("PATCHGEN_SHARED_PERFIX_CUDA_GRAPHS", "did you mean PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS?"),
    ("PATCHGEN_SHARED_PREFIX_TRAINING", "shared_prefix_training is a model config field"),
])
def test_misspelt_shared_prefix_variable_is_an_error_naming_what_was_meant(variable, meant):
    with pytest.raises(SettingError, match=re.escape(f"{variable}='1' is not one patchgen reads ({meant}")):
        check_environment({variable: "1"})


def test_every_shared_prefix_variable_is_accepted():
    check_environment({"PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS": "1", "PATCHGEN_SHARED_PREFIX_LEVEL_COST": "auto"})


class _Renaming:
    """A config whose class renames a field (transformers' attribute map) and computes another (a property)."""

    attribute_map: typing.ClassVar = {"shared_prefix_min_length": "min_tokens"}

    def __init__(self):
        self.min_tokens = 80

    def __getattribute__(self, name):
        return super().__getattribute__(type(self).attribute_map.get(name, name))

    @property
    def shared_prefix_max_depth(self):
        return 3


class _Slotted:
    __slots__ = ("shared_prefix_min_length",)

    def __init__(self):
        self.shared_prefix_min_length = 96


class _Forwarding:
    """A wrapper that hands every field it lacks to the config it wraps (``__getattr__``)."""

    def __init__(self):
        self.wrapped = Qwen3_5TextConfig(shared_prefix_min_length=112)

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


class _Redirecting:
    """A wrapper that reads every field but its own from the config it wraps (``__getattribute__``, no attribute map)."""

    def __init__(self):
        self.wrapped = Qwen3_5TextConfig(shared_prefix_min_length=112)

    def __getattribute__(self, name):
        if name == "wrapped" or name.startswith("__"):
            return super().__getattribute__(name)
        return getattr(super().__getattribute__("wrapped"), name)


class _Shadowing:
    """A field kept in the instance's dict that a property of its class computes instead (a data descriptor wins)."""

    def __init__(self):
        self.__dict__["shared_prefix_min_length"] = 80

    @property
    def shared_prefix_min_length(self):
        return 2 * self.__dict__["shared_prefix_min_length"]

    @shared_prefix_min_length.setter
    def shared_prefix_min_length(self, value):
        self.__dict__["shared_prefix_min_length"] = value


@pytest.mark.parametrize("make", [Qwen3_5TextConfig, Qwen3_5Config, _Renaming, _Slotted, _Forwarding, _Redirecting,
                                  _Shadowing])
def test_a_field_reads_what_getattr_reads_set_on_either_config_renamed_computed_or_unset(make):
    from patchgen.kernels.config import field

    config = make()
    for name in ("shared_prefix_min_length", "shared_prefix_max_depth", "shared_prefix_training", "vocab_size"):
        text = getattr(config, "text_config", None)
        expected = getattr(text if text is not None and hasattr(text, name) else config, name, "unset")
        assert field(config, name, "unset") == expected
    if isinstance(config, Qwen3_5TextConfig):
        config.shared_prefix_min_length = 128
        assert field(config, "shared_prefix_min_length") == 128
    if isinstance(config, Qwen3_5Config):
        config.shared_prefix_min_length = 128  # on the composite config
        assert field(config, "shared_prefix_min_length") == 128
        config.text_config.shared_prefix_min_length = 256
        with pytest.raises(SettingError, match="set it in one place"):
            field(config, "shared_prefix_min_length")


def test_a_per_layer_field_of_a_heterogeneous_config_is_refused_as_getattr_refuses_it():
    # one value for every layer would be a guess: transformers asks for the layer's config instead
    from patchgen.kernels.config import field

    config = Qwen3_5TextConfig(num_hidden_layers=4, shared_prefix_min_length=64,
                               per_layer_config={0: {"shared_prefix_min_length": 96}})
    with pytest.raises(RuntimeError, match="per-layer attribute") as refused:
        _ = config.shared_prefix_min_length
    with pytest.raises(type(refused.value), match="per-layer attribute"):
        field(config, "shared_prefix_min_length")


@pytest.mark.parametrize("variable", ["PATCHGEN_FLA_JOINT_ROUNDS", "PATCHGEN_FLA_CONV_LOOK_BACK"])
@pytest.mark.parametrize("value", ["false", "off", "no", "2"])
def test_an_fla_switch_other_than_0_or_1_is_an_error(variable, value):
    # kernels/backends/fla.py turns its path off only for "0": `false` silently kept it on
    with pytest.raises(SettingError, match=re.escape(f"{variable}={value!r}: expected 1 (on) or 0 (off)")):
        check_environment({variable: value})


def test_a_misspelt_fla_switch_is_an_error_naming_what_was_meant():
    with pytest.raises(SettingError, match=re.escape("did you mean PATCHGEN_FLA_JOINT_ROUNDS?")):
        check_environment({"PATCHGEN_FLA_JOINT_ROUND": "0"})


def test_the_fla_switches_accept_0_1_and_empty():
    for value in ("0", "1", ""):
        check_environment({"PATCHGEN_FLA_JOINT_ROUNDS": value, "PATCHGEN_FLA_CONV_LOOK_BACK": value})
