"""`bench/scoring_work.py` (FLOPs and bytes of the packed vs shared log-prob pass) and `bench/kernel_groups.py`
(the same groups over a GPU profile's kernels): run at tiny widths, they count what the passes do."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import kernel_groups
import scoring_work


@pytest.fixture(scope="module")
def tiny_results():
    return {arm: (packed, shared, info) for _, arm, packed, shared, info in scoring_work.main(["--tiny", "--padded"])}


def ratio(shared, packed, group, what="flops"):
    return getattr(shared, what)[group] / getattr(packed, what)[group]


def test_token_wise_work_of_the_shared_pass_is_c_over_t_of_packed(tiny_results):
    packed, shared, info = tiny_results["shared"]
    c_over_t = info["C"] / info["T"]
    assert c_over_t < 0.5
    for group in ("GEMMs (projections)", "conv", "rotary", "norms"):
        assert ratio(shared, packed, group) == pytest.approx(c_over_t, rel=1e-9), group
    assert ratio(shared, packed, "embedding", "bytes") == pytest.approx(c_over_t, rel=1e-9)


def test_attention_cannot_shrink_to_c_over_t(tiny_results):
    # every response's queries still read the whole prompt's keys
    packed, shared, info = tiny_results["shared"]
    assert ratio(shared, packed, "attention") > info["C"] / info["T"] * 1.05


def test_the_head_scores_each_distinct_row_once(tiny_results):
    packed, shared, info = tiny_results["shared"]
    # packed scores its T rows; shared one per compact row, plus one per extra member of the prompt's last row
    # (its next token differs per member). A pass without labels scores each sequence's last row too (nothing is
    # owed to it, but leaving it out would cost a host sync to count the rest: `lm_head._score_rows`)
    expected = (info["C"] + 3) / info["T"]
    assert ratio(shared, packed, "LM head + log-softmax") == pytest.approx(expected, rel=1e-3)


def test_a_bucket_padded_plan_runs_more_rows_than_the_compact_row(tiny_results):
    _, shared, info = tiny_results["shared"]
    _, padded, padded_info = tiny_results["shared, bucket-padded"]
    assert padded_info["C"] == info["C"] and padded_info["rows"] > info["C"]
    assert sum(padded.flops.values()) > sum(shared.flops.values())


def test_kernels_fall_into_the_accounting_groups():
    names = {
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NTT": "GEMMs (projections)",
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "GDN (delta rule)",
        "recompute_w_u_fwd_kernel": "GDN (delta rule)",
        "causal_conv1d_fwd_kernel": "conv",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256>>": "attention",
        "liger_cross_entropy_kernel": "LM head + log-softmax",
        "_rms_norm_forward_kernel": "norms",
        "void at::native::indexFuncLargeIndex<c10::BFloat16, long>": "gathers / scatters",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "copies / casts",
        "void at::native::vectorized_elementwise_kernel<4, ...>": "elementwise",
        "gpu_memcpy: Memcpy HtoD (Pinned -> Device)": "memcpy / memset",
        "gpu_memset: Memset (Device)": "memcpy / memset",
    }
    assert {name: kernel_groups.group_of(name) for name in names} == names


def test_the_group_table_charges_the_shared_pass_beyond_c_over_t():
    packed = {"nvjet_a": 1000.0, "flash_fwd": 400.0}
    shared = {"nvjet_a": 250.0, "flash_fwd": 200.0}
    lines = kernel_groups.table(packed, shared, 0.25).splitlines()
    gemm = next(line for line in lines if line.startswith("GEMMs"))
    attention = next(line for line in lines if line.startswith("attention"))
    assert gemm.split()[-1] == "0.00"  # 0.25 ms = 0.25 x 1 ms
    assert attention.split()[-1] == "0.10"  # 0.2 ms - 0.25 x 0.4 ms


def test_the_excess_by_kernel_lists_the_heaviest_first_and_counts_gemms_as_one():
    """cuBLAS names its GEMM kernels by tile shape, which the row count picks: the two passes' GEMMs differ by
    name and are compared as one line; a kernel only the shared pass runs (a plan's gather) is all excess."""
    packed = {"nvjet_tst_256x160": 1000.0, "direct_copy_kernel": 400.0, "flash_fwd": 100.0}
    shared = {"nvjet_tst_192x208": 320.0, "direct_copy_kernel": 200.0, "vectorized_gather_kernel": 50.0,
              "flash_fwd": 25.0}
    lines = kernel_groups.heaviest_excess(packed, shared, 0.25, top=3).splitlines()[1:]
    rows = [(float(line.split()[0]), line.split(" / ")[-1]) for line in lines]
    assert rows == [(0.1, "direct_copy_kernel"), (0.07, kernel_groups.GEMMS), (0.05, "vectorized_gather_kernel")]
