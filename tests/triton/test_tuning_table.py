"""The tuning table (kernels/triton/tuning_table.json): per device model, the launch preset a call gets
when it passes none; bench/triton_tuning.py --write-table fills it from a sweep."""

import importlib
import json

import pytest
import torch
from patchgen.kernels.errors import SettingError
from patchgen.kernels.triton import launch_config

# the package re-exports functions of the modules' names: take the modules themselves
conv_module = importlib.import_module("patchgen.kernels.triton.causal_conv1d")
norm_module = importlib.import_module("patchgen.kernels.triton.rms_norm_gated")
transposes = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.transposes")

CPU = torch.device("cpu")


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Point the kernels at a table of the test's own, and forget what was resolved from the real one."""
    path = tmp_path / "tuning_table.json"
    monkeypatch.setattr(launch_config, "TABLE_PATH", str(path))
    monkeypatch.setattr(conv_module, "TUNING", None)
    monkeypatch.setattr(norm_module, "TUNING", None)
    monkeypatch.setattr(transposes, "TUNING", None)
    launch_config._reset_table()
    yield path
    launch_config._reset_table()


def test_a_device_model_in_the_table_gets_its_entry(table):
    table.write_text(json.dumps({"cpu": {"causal_conv1d": "window,bwd_rows=8", "rms_norm_gated": "bwd-8sm"}}))
    conv = conv_module.default_tuning(CPU)
    assert conv.bwd_kernel == "window" and conv.bwd_rows == 8
    assert norm_module.default_tuning(CPU) == norm_module.PRESETS["bwd-8sm"]


def test_the_table_picks_the_gdn_backwards_transposes_design(table):
    table.write_text(json.dumps({"cpu": {"gated_delta_rule_transposes": "trans-wy"}}))
    assert transposes.transpose_tuning(CPU) == transposes.TransposeTuning(wy_bwd=True, output_bwd=False)
    launch_config._reset_table()
    table.write_text(json.dumps({"cpu": {}}))
    assert transposes.transpose_tuning(CPU) == transposes.DEFAULT == transposes.PRESETS["loaded"]


def test_a_device_model_not_in_the_table_gets_the_code_default(table):
    table.write_text(json.dumps({"NVIDIA H200": {"causal_conv1d": "window"}}))
    assert conv_module.default_tuning(CPU) == conv_module.DEFAULT
    assert norm_module.default_tuning(CPU) == norm_module.INTERPRETER  # the code's default for the interpreter
    assert norm_module.default_tuning(torch.device("meta")) == norm_module.DEFAULT


def test_no_table_file_means_the_code_defaults(table):
    assert conv_module.default_tuning(CPU) == conv_module.DEFAULT


def test_the_environment_variable_wins_over_the_table(table, monkeypatch):
    table.write_text(json.dumps({"cpu": {"rms_norm_gated": "bwd-8sm"}}))
    monkeypatch.setattr(norm_module, "TUNING", norm_module.PRESETS["fwd-4096"])  # what PATCHGEN_TRITON_NORM sets
    assert norm_module.default_tuning(CPU) == norm_module.PRESETS["fwd-4096"]


def test_a_table_entry_naming_no_preset_is_refused_naming_the_table(table):
    table.write_text(json.dumps({"cpu": {"causal_conv1d": "windw"}}))
    with pytest.raises(SettingError, match=r"tuning_table.json \['cpu'\]\['causal_conv1d'\]: 'windw': unknown "
                                           r"causal_conv1d launch preset 'windw'; known: tile-scratch"):
        conv_module.default_tuning(CPU)


def test_a_table_that_is_not_json_is_refused_with_the_fix(table):
    table.write_text("{not json")
    with pytest.raises(SettingError, match="not valid JSON .*--write-table"):
        conv_module.default_tuning(CPU)


def test_a_call_runs_with_the_tables_preset_and_stays_correct(table, monkeypatch):
    # the window design from the table, through the autograd call, against the float64 reference
    table.write_text(json.dumps({"cpu": {"causal_conv1d": "window,fwd_chunk=8,bwd_chunk=8"}}))
    used = []
    for name in ("_fwd_launch", "_bwd_launch"):
        launch = getattr(conv_module, name)
        monkeypatch.setattr(conv_module, name, lambda *a, _launch=launch: used.append(a[-1]) or _launch(*a))
    x = torch.randn(1, 21, 40, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 4, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 13, 21], dtype=torch.int32)
    y = conv_module.causal_conv1d(x, w, cu_seqlens=cu)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), dy)
    want_y = conv_module.causal_conv1d_reference(x, w, cu_seqlens=cu)
    want = torch.autograd.grad(want_y, (x, w), dy)
    torch.testing.assert_close(y, want_y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert len(used) == 2 and all(t.fwd_kernel == "window" and t.bwd_kernel == "window" and t.fwd_chunk == 8
                                  for t in used)


def test_the_committed_table_names_only_presets_that_exist():
    with open(launch_config.TABLE_PATH) as fh:
        committed = json.load(fh)
    modules = {"causal_conv1d": conv_module, "rms_norm_gated": norm_module, "gated_delta_rule_transposes": transposes}
    for model, entry in committed.items():
        for kernel, spec in entry.items():
            if kernel in modules:
                launch_config.parse_config(spec, modules[kernel].PRESETS, kernel, f"{model}/{kernel}")
