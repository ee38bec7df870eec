"""The per-level cost of a prefix tree: a figure read per device (config, environment, measured table), never timed."""

import json
import random
from types import SimpleNamespace

import pytest
from patchgen.kernels import config as kernel_config
from patchgen.kernels.errors import SettingError
from patchgen.kernels.shared_prefix import build_plan, level_cost
from patchgen.kernels.shared_prefix.level_cost import (
    ENV_LEVEL_COST,
    LEVEL_COST_TOKENS,
    TABLE,
    measured,
    resolve_level_cost,
)

from tests.models.prefix_trees import pack


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 150_000) for _ in range(n)]


def two_level_batch():
    """A second level saves 2 * (2 - 1) * 64 = 128 rows more than one level of the 200 shared rows."""
    seqs = [tokens(200, 0) + tokens(64, 1 + p) + tokens(4, 10 + 2 * p + r) for p in range(2) for r in range(2)]
    return pack(seqs)


@pytest.fixture
def cpu_measured(monkeypatch):
    """The table with a measurement for the CPU of `rows` rows."""

    def install(rows):
        entry = {"level_cost_rows": rows, "date": "2026-12-01"}
        monkeypatch.setattr(level_cost, "measured", lambda path=TABLE: {"cpu": entry})

    monkeypatch.delenv(ENV_LEVEL_COST, raising=False)
    return install


@pytest.mark.parametrize(("rows", "depth"), [(127, 2), (128, 1)])
def test_build_plan_charges_the_figure_measured_for_its_device(cpu_measured, rows, depth):
    cpu_measured(rows)
    plan = build_plan(*two_level_batch(), max_depth=2)
    assert plan.depth == depth
    assert plan.level_cost.rows == rows and plan.level_cost.source == "measured (cpu, 2026-12-01)"


def test_the_environment_wins_over_the_table(cpu_measured, monkeypatch):
    cpu_measured(128)
    monkeypatch.setenv(ENV_LEVEL_COST, "127")
    plan = build_plan(*two_level_batch(), max_depth=2)
    assert plan.depth == 2 and plan.level_cost == level_cost.LevelCost(127, ENV_LEVEL_COST)


def test_the_config_wins_over_the_environment(cpu_measured, monkeypatch):
    cpu_measured(0)
    monkeypatch.setenv(ENV_LEVEL_COST, "0")
    plan = build_plan(*two_level_batch(), max_depth=2, level_cost=128)
    assert plan.depth == 1 and plan.level_cost == level_cost.LevelCost(128, "config")


@pytest.mark.parametrize("text", ["", "auto", " auto "])
def test_an_empty_or_auto_environment_variable_defers_to_the_table(cpu_measured, monkeypatch, text):
    cpu_measured(127)
    monkeypatch.setenv(ENV_LEVEL_COST, text)
    assert resolve_level_cost("cpu").rows == 127


def test_a_device_nobody_measured_gets_the_estimate(monkeypatch):
    monkeypatch.setattr(level_cost, "measured", lambda path=TABLE: {})
    monkeypatch.delenv(ENV_LEVEL_COST, raising=False)
    cost = resolve_level_cost("cpu")
    assert cost.rows == LEVEL_COST_TOKENS and cost.source == "estimate (no measurement for cpu)"


@pytest.mark.parametrize("text", ["abc", "-1", "1.5", "256 rows"])
def test_a_bad_environment_value_names_the_variable_and_the_fix(monkeypatch, text):
    monkeypatch.setenv(ENV_LEVEL_COST, text)
    with pytest.raises(SettingError, match=rf"{ENV_LEVEL_COST}=.*must be a whole number of rows >= 0.*'auto'"):
        build_plan(*two_level_batch(), max_depth=2)


@pytest.mark.parametrize("value", [-1, 2.5, True, "256", "cheap"])
def test_a_bad_config_value_names_the_field(value):
    config = SimpleNamespace(shared_prefix_level_cost=value)
    with pytest.raises(SettingError, match="config field shared_prefix_level_cost must be a whole number"):
        kernel_config.shared_prefix_level_cost(config)


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("auto", None), (0, 0), (300, 300)])
def test_config_values_auto_or_rows(value, expected):
    assert kernel_config.shared_prefix_level_cost(SimpleNamespace(shared_prefix_level_cost=value)) == expected


def test_an_unset_config_field_is_auto():
    assert kernel_config.shared_prefix_level_cost(SimpleNamespace()) is None


def test_the_shipped_table_holds_whole_numbers_with_how_they_were_measured():
    devices = measured(TABLE)
    for name, entry in devices.items():
        assert entry["device"] == name
        for key in ("command", "date", "model", "torch", "fit", "points"):
            assert entry.get(key), f"{name}: no {key!r} in {TABLE.name}"


@pytest.mark.parametrize("rows", [-3, 1.5, None, True])
def test_a_table_entry_that_is_not_a_whole_number_is_refused(tmp_path, rows):
    path = tmp_path / "level_costs.json"
    path.write_text(json.dumps({"devices": {"NVIDIA X": {"level_cost_rows": rows}}}))
    with pytest.raises(ValueError, match="device 'NVIDIA X' has level_cost_rows="):
        measured(path)


def test_one_level_plans_do_not_read_the_cost(monkeypatch):
    monkeypatch.setenv(ENV_LEVEL_COST, "not a number")  # never read: max_depth=1 has no deeper level
    assert build_plan(*two_level_batch()).depth == 1
