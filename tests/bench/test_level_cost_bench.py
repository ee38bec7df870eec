"""bench/level_cost.py: the fit separates a level's cost from a row's, and --write records it where build_plan reads it."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import level_cost as bench
from patchgen.kernels.shared_prefix.level_cost import measured


def points(intercept_ms, ms_per_row, ms_per_level, noise=()):
    """Steps of a grid of (trees, depth) points, C shrinking with depth as on agentic batches."""
    out = []
    for i, (trees, levels) in enumerate((t, d) for t in (2, 4, 8) for d in (1, 2, 3)):
        c = trees * {1: 6656, 2: 5120, 3: 4608}[levels]
        ms = intercept_ms + ms_per_row * c + ms_per_level * levels + (noise[i] if noise else 0.0)
        out.append({"trees": trees, "depth": levels, "levels": levels, "T": trees * 14336, "C": c, "ms": ms})
    return out


def test_the_fit_recovers_the_rows_a_level_is_worth():
    result = bench.fit(points(40.0, 0.002, 1.5))
    assert result["level_cost_rows"] == 750  # 1.5 ms / 2 us a row
    assert result["us_per_row"] == pytest.approx(2.0) and result["ms_per_level"] == pytest.approx(1.5)
    assert max(abs(r) for r in result["residuals_ms"]) < 1e-6


def test_noise_shows_in_the_standard_errors():
    noisy = bench.fit(points(40.0, 0.002, 1.5, noise=[0.3, -0.2, 0.1, -0.3, 0.2, 0.0, 0.1, -0.1, 0.2]))
    assert (
        noisy["ms_per_level_se"] > 0 and abs(noisy["ms_per_level"] - 1.5) < 3 * noisy["ms_per_level_se"] + 0.5
    )


def test_a_level_that_makes_the_step_faster_costs_zero_rows():
    assert bench.fit(points(40.0, 0.002, -0.5))["level_cost_rows"] == 0


def test_a_step_that_does_not_grow_with_its_rows_is_refused():
    with pytest.raises(SystemExit, match="host-bound"):
        bench.fit(points(40.0, 0.0, 1.5))


def test_write_records_the_figure_under_the_device_name(tmp_path):
    path = tmp_path / "level_costs.json"
    path.write_text(json.dumps({"about": "kept", "devices": {"NVIDIA A": {"level_cost_rows": 9}}}))
    bench.write(path, "NVIDIA B", {"level_cost_rows": 750, "device": "NVIDIA B", "date": "2026-12-01"})
    table = measured(path)
    assert table["NVIDIA B"]["level_cost_rows"] == 750 and table["NVIDIA A"]["level_cost_rows"] == 9
    assert json.loads(path.read_text())["about"] == "kept"


@pytest.mark.parametrize(
    "argv", [["--tiny", "--write"], ["--trees", "4"], ["--depths", "1"], ["--trees", "0,2"]]
)
def test_arguments_that_cannot_give_a_figure_are_refused(argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def printed(points_, device="NVIDIA X"):
    """A run's output as level_cost.py prints it, cut before the fit (as a device run's time cap cuts it)."""
    lines = [
        f"{device}: 32 layers, torch.bfloat16, training step; median of 5",
        "trees max_depth levels  T  C  ms  spread",
    ]
    lines += [
        f"{p['trees']:>5} {p['depth']:>9} {p['levels']:>6} {p['T']:>7} {p['C']:>7} {p['ms']:>9.4f} 1.00"
        for p in points_
    ]
    return "\n".join(["== level: start at 0 s, cap 200 s", *lines, "== level: rc 124 in 200 s"])


def test_a_cut_run_is_fitted_from_its_printed_points_and_recorded_with_its_versions(tmp_path):
    log, env, table = tmp_path / "run.txt", tmp_path / "env.txt", tmp_path / "level_costs.json"
    log.write_text(printed(points(40.0, 0.002, 1.5)[:8]))
    env.write_text(
        "torch 2.11.0 triton 3.6.0 transformers 5.24.0 NVIDIA X x 1\non request: triton 3.7.1 from /tmp\n"
    )
    table.write_text(json.dumps({"about": "kept", "devices": {}}))
    bench.main(["--from-log", str(log), "--env-log", str(env), "--table", str(table), "--write"])
    entry = measured(table)["NVIDIA X"]
    assert entry["level_cost_rows"] == 750 and len(entry["points"]) == 8
    assert (entry["torch"], entry["triton"], entry["transformers"]) == ("2.11.0", "3.7.1", "5.24.0")
    assert "32 layers" in entry["model"]


def test_a_log_without_points_over_two_depths_is_refused(tmp_path):
    log = tmp_path / "run.txt"
    log.write_text(printed([p for p in points(40.0, 0.002, 1.5) if p["levels"] == 1]))
    with pytest.raises(SystemExit, match="too few depths"):
        bench.main(["--from-log", str(log)])


def test_a_missing_log_is_named_in_the_error(tmp_path):
    with pytest.raises(SystemExit, match="no file .*absent.txt"):
        bench.main(["--from-log", str(tmp_path / "absent.txt")])
