"""Errors about model settings name the config field the user sets (issue 14, item 6)."""

import pytest
from patchgen.kernels.errors import SettingError

from tests.models import tiny


def test_bad_min_length_set_after_build_names_the_config_field_at_forward():
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    net.config.shared_prefix_min_length = 0
    ids, cu = tiny.packed_batch([10, 10], shared=6, seed=1)
    with pytest.raises(SettingError, match="config field shared_prefix_min_length"):
        net(input_ids=ids, **tiny.packed_kwargs(cu))


def test_typo_in_a_patchgen_field_fails_at_model_build():
    with pytest.raises(SettingError, match="did you mean 'shared_prefix_training'"):
        tiny.build("qwen3_5", "gpu", shared_prefix_trainin=True)


@pytest.mark.parametrize(
    ("field", "value"), [("shared_prefix_max_depth", 0), ("shared_prefix_level_cost", -1), ("shared_prefix_max_depth", 2.5)]
)
def test_bad_tree_setting_names_the_config_field_at_build(field, value):
    with pytest.raises(SettingError, match=f"config field {field}"):
        tiny.build("qwen3_5", "gpu", **{field: value})


def test_typo_in_a_tree_field_fails_at_model_build():
    with pytest.raises(SettingError, match="did you mean 'shared_prefix_max_depth'"):
        tiny.build("qwen3_5", "gpu", shared_prefix_max_dept=2)


def test_non_bool_verify_flag_names_the_config_field_at_build():
    with pytest.raises(SettingError, match="config field shared_prefix_verify must be True or False"):
        tiny.build("qwen3_5", "gpu", shared_prefix_verify="yes")


def test_a_level_cost_written_as_text_names_the_config_field_at_build():
    with pytest.raises(SettingError, match="config field shared_prefix_level_cost must be a whole number of rows"):
        tiny.build("qwen3_5", "gpu", shared_prefix_level_cost="256")


def test_a_bad_level_cost_in_the_environment_names_the_variable_at_forward(monkeypatch):
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_level_cost="auto")
    monkeypatch.setenv("PATCHGEN_SHARED_PREFIX_LEVEL_COST", "-5")
    ids, cu = tiny.packed_batch([10, 10], shared=6, seed=1)
    with pytest.raises(SettingError, match="PATCHGEN_SHARED_PREFIX_LEVEL_COST='-5' must be a whole number"):
        net(input_ids=ids, **tiny.packed_kwargs(cu))


def test_a_misspelt_shared_prefix_variable_fails_at_model_build_naming_the_variable_meant(monkeypatch):
    """Read nowhere, the misspelt variable would leave the graphs off without a word."""
    monkeypatch.setenv("PATCHGEN_SHARED_PREFIX_CUDA_GRAPH", "1")
    with pytest.raises(SettingError, match=r"PATCHGEN_SHARED_PREFIX_CUDA_GRAPH='1' is not one patchgen reads "
                                           r"\(did you mean PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS\?\)"):
        tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
