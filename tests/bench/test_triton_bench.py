"""The Triton-kernel bench scripts (bench/triton_*.py, bench/triton_floor_run.sh), checked on the CPU.

bench/triton_kernels.py --tiny runs every op and arm through Triton's interpreter at tiny widths; the
device run (one call, issue 17) must not be where a broken script or a bench bug is found.
"""

import csv
import json
import math
import os
import sys
import tarfile
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import triton_kernels
import triton_presets
import triton_tuning

from tests.bench.device_stub import run_device_script

interpreter_only = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the tiny bench runs Triton's interpreter (CPU); on a GPU machine the bench itself runs")


@pytest.fixture(scope="module")
def tiny_rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton_bench") / "t.csv"
    rows = triton_kernels.main(["--tiny", "--csv", str(path), "--arms", "ours,torch", "--repeats", "1",
                                "--warmup", "0", "--host-calls", "1",
                                "--ops", "causal_conv1d,rms_norm_gated,gated_delta_rule_h0"])
    return rows, list(csv.DictReader(path.open()))


@interpreter_only
def test_the_tiny_bench_times_every_op_pass_and_arm_without_errors(tiny_rows):
    measured, written = tiny_rows
    want = [(op, p, arm) for op in ("causal_conv1d", "rms_norm_gated", "gated_delta_rule_h0")
            for p in ("fwd", "fwd+bwd") for arm in ("ours", "torch")]
    assert [(r["op"], r["pass"], r["arm"]) for r in written] == want
    for raw, r in zip(measured, written):
        assert r["error"] == "" and float(r["ms"]) > 0, r
        # the CSV keeps 3 decimals of x_floor: against the unrounded times (a tiny floor rounded to 4
        # decimals moves the ratio of the rounded times by more than that)
        assert float(r["x_floor"]) == pytest.approx(raw["ms"] / raw["floor_ms"], rel=1e-9, abs=5.001e-4)
        assert r["case"] == triton_kernels.TINY.describe()


@interpreter_only
def test_host_time_is_measured_for_our_kernels_and_not_for_the_reference(tiny_rows):
    for r in tiny_rows[1]:
        host = float(r["host_ms"])
        assert (host > 0) if r["arm"] == "ours" else math.isnan(host), r


def test_the_torch_gdn_arm_takes_half_inputs_beside_an_fp32_state():
    # the bench bug of 2026-11-30: bf16 q..beta next to the fp32 initial state failed this arm
    case = triton_kernels.TINY
    (q, k, v, g, beta, h0), tables = triton_kernels.gdn_inputs(False, with_state=True, case=case)
    half = [t.to(torch.bfloat16) for t in (q, k, v, beta)]
    o, final = triton_kernels.gdn_arms(True, ("torch",))["torch"](*half[:3], g, half[3], h0, *tables)
    from patchgen.kernels.reference import gated_delta_rule as reference

    want_o, want_final = reference.gated_delta_rule(
        *(t.float() for t in half[:3]), g, half[3].float(), initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=tables[0], cu_seqlens_cpu=tables[1])
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)
    torch.testing.assert_close(final, want_final, rtol=0, atol=0)


def test_the_tiny_case_ends_a_sequence_inside_a_chunk():
    cu = triton_kernels.cu_seqlens_of(triton_kernels.TINY)
    assert cu.tolist() == [0, 117, 160] and 117 % 64 and 43 % 64


def test_a_case_whose_lengths_do_not_fill_the_row_is_refused():
    with pytest.raises(ValueError, match="summing to T=10"):
        triton_kernels.Case(T=10, N=2, lengths=(4, 4))


@pytest.mark.parametrize("flag, value", [("--ops", "causal_conv1d,conv"), ("--arms", "ours,liger"), ("--ops", "")])
def test_unknown_ops_or_arms_are_refused_naming_the_known_ones(flag, value, capsys):
    with pytest.raises(SystemExit):
        triton_kernels.parse_args([flag, value])
    err = capsys.readouterr().err
    assert "comma-separated subset of" in err and ("causal_conv1d" in err or "ours" in err)


def test_the_profile_byte_model_counts_fp32_intermediates_at_four_bytes():
    import triton_profile

    c = triton_kernels.BENCH
    model = triton_profile.kernel_bytes(c)
    # wy_bwd reads dw, du and dk in fp32 and writes dk in fp32: 4 [T, HV, 128] fp32 tensors among its bytes
    assert model["wy_bwd_kernel"] > 4 * c.T * c.HV * 128 * 4
    assert model["rms_norm_gated_bwd_kernel"] == 5 * c.T * c.HV * c.V * 2 + c.T * c.HV * 4
    assert triton_profile.short_name("void at::native::reduce_kernel<512, 1>(float*)") == "at::native::reduce_kernel"


def test_a_preset_must_beat_the_current_default_by_the_margin_to_replace_it():
    assert triton_presets.pick({"a": 1.00, "b": 0.98}, current="a") == "a"  # 2%: noise
    assert triton_presets.pick({"a": 1.00, "b": 0.90}, current="a") == "b"
    assert triton_presets.pick({"a": float("nan"), "b": 0.90}, current="a") == "b"  # the default failed its check
    assert triton_presets.pick({"a": 1.00, "b": 0.99}, current=None) == "b"
    assert triton_presets.pick({"a": float("nan")}, current="a") is None


def test_write_table_puts_the_sweeps_presets_under_its_gpu_and_keeps_other_entries(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"NVIDIA H100": {"rms_norm_gated": "bwd-8sm"},
                                 "NVIDIA H200": {"causal_conv1d": "tile-scratch", "rms_norm_gated": "default"}}))
    result = tmp_path / "tuning.json"
    result.write_text(json.dumps({"device": "NVIDIA H200", "triton": "3.7.1",
                                  "presets": {"causal_conv1d": "window-fast", "gated_delta_rule_transposes": "trans"}}))
    triton_tuning.main(["--write-table", str(result), "--table", str(table)])
    got = json.loads(table.read_text())
    assert got["NVIDIA H100"] == {"rms_norm_gated": "bwd-8sm"}
    assert got["NVIDIA H200"]["causal_conv1d"] == "window-fast"
    assert got["NVIDIA H200"]["rms_norm_gated"] == "default"
    assert got["NVIDIA H200"]["gated_delta_rule_transposes"] == "trans"
    assert "Triton 3.7.1" in got["NVIDIA H200"]["measured"]


def test_write_table_refuses_a_preset_the_kernel_does_not_have(tmp_path):
    result = tmp_path / "tuning.json"
    result.write_text(json.dumps({"device": "NVIDIA H200", "presets": {"causal_conv1d": "no-such"}}))
    with pytest.raises(SystemExit, match="'no-such' is not one of tile-scratch"):
        triton_tuning.write_table(str(result), str(tmp_path / "table.json"))


def _run_floor_script(tmp_path, budget: int):
    """bench/triton_floor_run.sh with a stub environment and a `python` that exits at once with 3."""
    return run_device_script(tmp_path, "triton_floor_run.sh", BUDGET=budget)


def test_the_device_script_reports_every_part_and_packs_one_tarball(tmp_path):
    proc, out = _run_floor_script(tmp_path, budget=600)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["steps.txt", "triton_floor.tar.gz"]
    with tarfile.open(out / "triton_floor.tar.gz") as tar:
        names = set(tar.getnames())
        steps = tar.extractfile("r/steps.txt").read().decode()
    for part in ("warm-fla-371", "warm-ours-371", "warm-presets-371", "gpu-tests-371", "warm-transposes-371",
                 "sweep-371", "bench-371", "profile-371", "transposes-371", "sweep-360", "bench-360"):
        assert f"== {part}: rc 3 in" in steps, steps  # ran, and its exit status is said
    assert "r/sweep_triton371.txt" in names and "r/triton_kernels_triton371.txt" in names


def test_the_device_script_skips_the_parts_its_budget_cannot_hold(tmp_path):
    proc, out = _run_floor_script(tmp_path, budget=20)
    assert proc.returncode == 0, proc.stderr
    steps = (out / "steps.txt").read_text()
    assert steps.count("skipped") == 11 and "rc 3" not in steps


@pytest.mark.gpu
def test_the_fla_norm_arm_differentiates_the_weight_it_is_given():
    # the bench bug of 2026-11-30: fla's module used its own weight, so the passed one got no gradient
    pytest.importorskip("fla")
    case = triton_kernels.Case(T=256, N=2, H=2, HV=4, K=16, V=128, device="cuda")
    arms = triton_kernels.norm_arms(("fla", "torch"))
    (x, gate, w), _ = triton_kernels.norm_inputs(True, case)
    dy = torch.randn_like(x)
    got, want = (torch.autograd.grad(arms[a](x, gate, w), (x, gate, w), dy) for a in ("fla", "torch"))
    for name, a, b in zip(("dx", "dgate", "dweight"), got, want):
        err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        assert err < 8e-3, (name, err)  # one bf16 rounding of each element (tests/triton/test_gpu.py's bound)
