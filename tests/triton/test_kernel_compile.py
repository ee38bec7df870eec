"""Our Triton kernels compile for the H200 (sm_90), checked on CPU.

The other tests here run the kernels through Triton's interpreter, which accepts code Triton's compiler
refuses. compile_kernels.py (its own process: kernels must not be interpreted there) records every launch
our launchers make, for every preset and design, in fp32, bf16, fp16 and fp64, with the choices a compiled
device makes (CUDA's, and the portable ones the npu target gets), and compiles each specialisation: the
frontend (Python to TTIR) for all, and on to TTGIR for the configurations the H200 runs in bf16.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PACKAGE = "patchgen.kernels.triton"

# Every kernel our launchers start (a kernel of the package missing here, or not launched by a case of
# kernel_launch_cases.py, fails test_every_kernel_of_ours_is_compiled).
ENTRY_KERNELS = {f"{PACKAGE}.{name}" for name in (
    "_common.sum_partials_kernel",
    "causal_conv1d.causal_conv1d_fwd_kernel",
    "causal_conv1d.causal_conv1d_bwd_kernel",
    "causal_conv1d.causal_conv1d_bwd_recompute_kernel",
    "causal_conv1d_window.causal_conv1d_fwd_window_kernel",
    "causal_conv1d_window.causal_conv1d_bwd_window_kernel",
    "causal_conv1d_segment.causal_conv1d_fwd_segment_kernel",
    "causal_conv1d_segment.causal_conv1d_bwd_segment_kernel",
    "causal_conv1d_state.causal_conv1d_state_fwd_kernel",
    "causal_conv1d_state.causal_conv1d_state_bwd_kernel",
    "rms_norm_gated.rms_norm_gated_fwd_kernel",
    "rms_norm_gated.rms_norm_gated_bwd_kernel",
    "log_probs.row_log_probs_kernel",
    "gated_delta_rule.varlen.chunk_offsets_kernel",
    "gated_delta_rule.l2norm.l2norm_fwd_kernel",
    "gated_delta_rule.l2norm.l2norm_bwd_kernel",
    "gated_delta_rule.cumsum.chunk_cumsum_kernel",
    "gated_delta_rule.wy.wy_fwd_kernel",
    "gated_delta_rule.wy.wy_bwd_kernel",
    "gated_delta_rule.chunk_state.chunk_state_fwd_kernel",
    "gated_delta_rule.chunk_state.chunk_state_bwd_kernel",
    "gated_delta_rule.chunk_output.chunk_output_fwd_kernel",
    "gated_delta_rule.chunk_output.chunk_output_bwd_kernel",
)}
DTYPES = ("fp32", "bf16", "fp16", "fp64")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """compile_kernels.py's report, run once for this module (about 20 s on 2 cores)."""
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PATCHGEN_TRITON_CONV",
                                                            "PATCHGEN_TRITON_NORM")}
    run = subprocess.run([sys.executable, str(HERE / "compile_kernels.py"), "--budget", "--self-check",
                          "--json", str(out)], env=env, capture_output=True, text=True, timeout=600, check=False)
    if not out.exists():
        pytest.fail(f"compile_kernels.py wrote no report (exit {run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}")
    return json.loads(out.read_text())


def _launches(report, kernel):
    return [launch for launch in report["launches"] if launch["kernel"] == kernel]


def test_every_kernel_of_ours_is_compiled(report):
    assert set(report["entry_kernels"]) == ENTRY_KERNELS


def test_every_jit_helper_is_compiled_inside_a_kernel(report):
    assert set(report["jit_functions"]) - set(report["reached"]) == set()


@pytest.mark.parametrize("kernel", sorted(ENTRY_KERNELS), ids=lambda name: name.rsplit(".", 1)[1])
def test_every_specialisation_compiles_for_sm90(report, kernel):
    launches = _launches(report, kernel)
    assert launches, f"no case launched {kernel}"
    failed = [f"{launch['failed_stage']}: {launch['constexprs']} ({', '.join(launch['cases'][:2])})\n{launch['error']}"
              for launch in launches if launch["error"]]
    assert not failed, "\n\n".join(failed)


def test_what_the_h200_runs_reaches_ttgir(report):
    deep = [launch for launch in report["launches"] if launch["deep"] and launch["kernel"] not in report["slow_to_lower"]]
    modules = {launch["kernel"].rsplit(".", 1)[0].removeprefix(PACKAGE + ".") for launch in deep}
    assert {"causal_conv1d", "causal_conv1d_state", "rms_norm_gated", "gated_delta_rule.wy"} <= modules
    assert [launch for launch in deep if launch["stages"][-1][0] != "ttgir"] == []


def test_other_specialisations_reach_ttir(report):
    assert all(launch["stages"][-1][0] in ("ttir", "ttgir") for launch in report["launches"] if not launch["error"])


@pytest.mark.parametrize("module, what", [("causal_conv1d", "conv"), ("rms_norm_gated", "norm"),
                                          ("gated_delta_rule.transposes", "gdn")])
def test_every_preset_is_compiled_in_fp32_and_bf16(report, module, what):
    presets = importlib.import_module(f"{PACKAGE}.{module}").PRESETS
    cases = {case for launch in report["launches"] for case in launch["cases"]}
    for dtype in ("float32", "bfloat16"):
        missing = [name for name in presets
                   if not any(case.startswith(f"cuda: {what} {name} ") and case.endswith(dtype) for case in cases)]
        assert not missing, f"{what} presets not compiled in {dtype}: {missing}"


@pytest.mark.parametrize("kernel", sorted(ENTRY_KERNELS - {f"{PACKAGE}.gated_delta_rule.varlen.chunk_offsets_kernel"}),
                         ids=lambda name: name.rsplit(".", 1)[1])
def test_every_kernel_is_compiled_in_every_dtype(report, kernel):
    pointers = {ty.lstrip("*") for launch in _launches(report, kernel) for ty in launch["args"].values()
                if ty.startswith("*")}
    assert set(DTYPES) <= pointers


def test_the_check_fails_on_a_name_with_two_block_shapes_across_an_if(report):
    (check,) = report["self_check"]
    assert check["failed_stage"] == "ast"
    assert "Mismatched type for part" in check["error"]


def test_the_interpreter_runs_that_kernel():
    """Why the check is needed: the interpreter runs the kernel the compiler refuses."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("compiled Triton refuses the kernel (the test above); this shows the interpreter does not")
    import compile_fixtures

    x, y = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    compile_fixtures.launch(x, y, 1)
    assert torch.equal(y[:32], x[:32] * 2) and torch.equal(y[32:48], x[:16] * 3)
