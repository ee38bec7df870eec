"""The GPU benchmark scripts, run on the CPU at tiny widths: they measure what they claim to measure.

A benchmark that breaks is found on the GPU machine, where time is scarce; these runs find it here.
"""

import csv
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import merge_shared_prefix
import shared_prefix_gpu


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    shared_prefix_gpu.main(["--tiny", "--no-upstream", "--out", str(out), "--repeats", "1", "--warmup", "0"])
    return out


def rows_of(path):
    return list(csv.DictReader(path.open()))


def test_correctness_rows_compare_flag_on_off_and_a_real_noise_floor(tiny_run):
    # float32 here: flag on vs off differ only by summation order (prefix gradients are summed over
    # the group's members), so within float32 rounding; the floor is measured, never zero.
    rows = {row["quantity"]: row for row in rows_of(tiny_run / "correctness_cpu-tiny.csv")}
    assert set(rows) == {"logits", "loss", "grads"}
    for row in rows.values():
        assert float(row["shared_vs_packed_rel"]) < 1e-5, row
        assert float(row["noise_floor_rel"]) > 0, row


def test_speed_rows_carry_bound_efficiency_and_plan_time(tiny_run):
    rows = rows_of(tiny_run / "shared_prefix_cpu-tiny.csv")
    assert [row["shape"] for row in rows] == ["tiny n=4 P=192 R=32", "tiny system", "tiny system tree", "tiny agentic"]
    for row in rows:
        T, C = int(row["T"]), int(row["C"])
        assert C < T and float(row["bound"]) == pytest.approx(T / C)
        speedup = float(row["packed_train_ms"]) / float(row["shared_train_ms"])
        assert float(row["efficiency_train"]) == pytest.approx(speedup / (T / C))
        assert float(row["plan_ms"]) > 0


def test_tree_shapes_run_as_trees(tiny_run):
    rows = {row["shape"]: row for row in rows_of(tiny_run / "shared_prefix_cpu-tiny.csv")}
    assert (int(rows["tiny system"]["levels"]), int(rows["tiny system tree"]["levels"])) == (1, 2)
    assert int(rows["tiny system tree"]["C"]) == 64 + 2 * 64 + 4 * 4
    assert int(rows["tiny agentic"]["levels"]) == 2


def test_an_agentic_shape_branches_at_every_turn():
    # one prompt of 64 tokens, two shared turns of 128 tokens, each branching in two, then 4 own tokens
    *_, seqs = shared_prefix_gpu.batch([(8, 64, 4)], [], 512, "cpu", turns=(128, 128))
    assert [len(s) for s in seqs] == [64 + 128 + 128 + 4] * 8
    assert all((s[:64] == seqs[0][:64]).all() for s in seqs)
    for j in range(8):  # rollouts j and j ^ 1 share both turns, j and j ^ 2 only the first
        assert (seqs[j][:320] == seqs[j ^ 1][:320]).all() and not (seqs[j][320:] == seqs[j ^ 1][320:]).all()
        assert (seqs[j][:192] == seqs[j ^ 2][:192]).all() and not (seqs[j][192:320] == seqs[j ^ 2][192:320]).all()
        assert not (seqs[j][64:192] == seqs[j ^ 4][64:192]).all()


def test_a_system_prompt_common_to_two_groups_is_shared():
    # two groups of 2 with 96-token prompts whose first 80 tokens are one system prompt
    *_, seqs = shared_prefix_gpu.batch([(2, 96, 16), (2, 96, 16)], [], 512, "cpu", system=80)
    assert all((seq[:80] == seqs[0][:80]).all() for seq in seqs)
    assert not (seqs[0][80:96] == seqs[2][80:96]).all()


def test_grid_has_every_shape_of_the_issue_and_the_controls():
    names = [name for name, *_ in shared_prefix_gpu.parse_shapes("grid")]
    assert len(names) == 2 * 4 * 2 + 7
    assert "n=8 P=8192 R=512" in names and "n=4 P=512 R=256" in names
    assert any(name.startswith("split") for name in names) and any(name.startswith("system") for name in names)
    assert any(name.startswith("system tree") for name in names)
    assert sum(name.startswith("agentic") for name in names) == 3


def test_merge_takes_each_column_once_and_recomputes_the_ratios(tmp_path):
    ours, upstream = tmp_path / "ours.csv", tmp_path / "up.csv"
    shared_prefix_gpu.write([{"shape": "n=4 P=1024 R=256", "T": 5120, "C": 2048, "bound": 2.5,
                              "packed_train_ms": 100.0, "shared_train_ms": 50.0, "packed_logprob_ms": 30.0,
                              "shared_logprob_ms": 15.0, "packed_train_peak_gib": 10.0, "shared_train_peak_gib": 6.0,
                              "packed_train_step_gib": 4.0, "shared_train_step_gib": 1.0}], ours)
    shared_prefix_gpu.write([{"shape": "n=4 P=1024 R=256", "T": 5120, "C": 2048, "bound": 2.5,
                              "upstream_train_ms": 150.0, "upstream_logprob_ms": 60.0}], upstream)
    (row,) = merge_shared_prefix.merge([ours, upstream])
    assert row["efficiency_train"] == pytest.approx(2.0 / 2.5)
    assert row["packed_vs_upstream_train"] == pytest.approx(1.5)
    assert row["packed_vs_upstream_logprob"] == pytest.approx(2.0)
    assert row["memory_ratio_train"] == pytest.approx(0.6)


def test_grpo_trl_bench_runs_the_three_arms_on_one_micro_batch(tmp_path, monkeypatch):
    import grpo_trl

    monkeypatch.setenv("PATCHGEN_DEVICE_TARGET", "cpu")
    out = tmp_path / "grpo.csv"
    grpo_trl.main(["--prompt-len", "96", "--response-len", "8", "--repeats", "1", "--warmup", "0",
                   "--device", "cpu", "--out", str(out)])
    rows = {row["arm"]: row for row in rows_of(out)}
    assert list(rows) == ["stock", "packed", "shared"]
    shared = rows["shared"]
    assert int(shared["tokens_compact"]) < int(shared["tokens_packed"]) < int(shared["tokens_padded"])
    for arm in ("packed", "shared"):
        # float32: TRL's fused head (stock) and ours sum in different orders
        assert float(rows[arm]["loss"]) == pytest.approx(float(rows["stock"]["loss"]), abs=1e-5)
        assert float(rows[arm]["logp_diff"]) < 1e-4
