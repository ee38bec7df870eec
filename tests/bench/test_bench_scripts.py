"""The GPU benchmark scripts, run on the CPU at tiny widths: they measure what they claim to measure.

A benchmark that breaks is found on the GPU machine, where time is scarce; these runs find it here.
"""

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import merge_shared_prefix
import shared_prefix_arms
import shared_prefix_gpu
import shared_prefix_report
import shared_prefix_timing
import torch


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    # Two depths in one run, as on the GPU (8,32 there); one timed call per measurement; a one-level
    # and a tree shape (the other tiny shapes' plans are checked without timing them).
    out = tmp_path_factory.mktemp("bench")
    shared_prefix_gpu.main(["--tiny", "--layers", "4,8", "--shapes", "n4,system-tree", "--out", str(out),
                            "--repeats", "1", "--min-repeats", "1", "--warmup", "0"])
    return out


def rows_of(path):
    return list(csv.DictReader(path.open()))


def test_correctness_rows_compare_flag_on_off_and_a_real_noise_floor_at_each_depth(tiny_run):
    # float32 here: flag on vs off differ only by summation order (prefix gradients are summed over
    # the group's members), so within float32 rounding; the floor is measured, never zero.
    rows = rows_of(tiny_run / "correctness_cpu-tiny.csv")
    assert [(row["layers"], row["quantity"]) for row in rows] == [
        (layers, what) for layers in ("4", "8") for what in ("logits", "loss", "grads")
    ]
    for row in rows:
        assert float(row["shared_vs_packed_rel"]) < 1e-5, row
        assert float(row["noise_floor_rel"]) > 0, row
        assert row["bit_identical"] == str(float(row["shared_vs_packed_max"]) == 0.0)


def test_one_run_measures_every_shape_at_every_depth(tiny_run):
    rows = rows_of(tiny_run / "shared_prefix_cpu-tiny.csv")
    shapes = ["tiny n=4 P=192 R=32", "tiny system tree"]
    assert [(row["layers"], row["shape"]) for row in rows] == [(layers, s) for layers in ("4", "8") for s in shapes]
    table = (tiny_run / "shared_prefix_cpu-tiny.md").read_text()
    assert table.count("| tiny ") == 4 and "host / GPU ms shared" in table


def test_layers_must_be_distinct_depths():
    for bad in ("8,8", "eight", ""):
        with pytest.raises(SystemExit, match="--layers"):
            shared_prefix_gpu.parse_args(["--layers", bad])


def test_speed_rows_carry_bound_efficiency_and_plan_time(tiny_run):
    rows = rows_of(tiny_run / "shared_prefix_cpu-tiny.csv")
    for row in rows:
        T, C = int(row["T"]), int(row["C"])
        assert C < T and float(row["bound"]) == pytest.approx(T / C)
        speedup = float(row["packed_train_ms"]) / float(row["shared_train_ms"])
        assert float(row["efficiency_train"]) == pytest.approx(speedup / (T / C))
        assert float(row["plan_ms"]) > 0


def test_the_shared_arm_is_checked_bit_for_bit_against_packed_at_every_shape(tiny_run):
    for row in rows_of(tiny_run / "shared_prefix_cpu-tiny.csv"):
        assert row["loss_bitequal"] in ("True", "False") and row["logprobs_bitequal"] in ("True", "False")
        same = float(row["loss_packed"]) == float(row["loss_shared"])
        assert same or row["loss_bitequal"] == "False", row


def test_host_and_gpu_time_are_reported_for_both_of_our_arms(tiny_run):
    for row in rows_of(tiny_run / "shared_prefix_cpu-tiny.csv"):
        for arm in ("packed", "shared"):
            host, wall = float(row[f"{arm}_host_ms"]), float(row[f"{arm}_profiled_wall_ms"])
            assert 0 < host <= wall
            assert float(row[f"{arm}_wait_ms"]) == 0  # no device to wait for on the CPU
            assert row[f"{arm}_gpu_ms"] == "nan" and row[f"{arm}_kernels"] == "-1"  # no GPU: said, not guessed


def test_tree_shapes_run_as_trees():
    shapes = shared_prefix_gpu.tiny_shapes("grid")
    rows = {shape.name: shared_prefix_gpu.shape_row(shape, 4, 512, "cpu")[0] for shape in shapes}
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


def test_merge_takes_each_column_once_per_depth_and_recomputes_the_ratios(tmp_path):
    ours, upstream, old = tmp_path / "ours.csv", tmp_path / "up.csv", tmp_path / "old.csv"
    shape = {"shape": "n=4 P=1024 R=256", "T": 5120, "C": 2048, "bound": 2.5}
    shared_prefix_gpu.write([{"layers": 32, **shape, "packed_train_ms": 100.0, "shared_train_ms": 50.0,
                              "packed_logprob_ms": 30.0, "shared_logprob_ms": 15.0, "packed_train_peak_gib": 10.0,
                              "shared_train_peak_gib": 6.0, "packed_train_step_gib": 4.0,
                              "shared_train_step_gib": 1.0, "packed_train_activation_gib": 3.0,
                              "shared_train_activation_gib": 0.5}], ours)
    shared_prefix_gpu.write([{"layers": 32, **shape, "upstream_liger_train_ms": 150.0,
                              "upstream_liger_logprob_ms": 60.0}], upstream)
    shared_prefix_gpu.write([{**shape, "packed_train_ms": 80.0, "shared_train_ms": 80.0}], old)  # before `layers`
    eight, thirty_two = merge_shared_prefix.merge([ours, upstream, old])
    assert (eight["layers"], eight["efficiency_train"]) == (8, pytest.approx(1 / 2.5))
    assert thirty_two["layers"] == 32
    assert thirty_two["efficiency_train"] == pytest.approx(2.0 / 2.5)
    assert thirty_two["packed_vs_upstream_liger_train"] == pytest.approx(1.5)
    assert thirty_two["packed_vs_upstream_liger_logprob"] == pytest.approx(2.0)
    assert thirty_two["memory_ratio_train"] == pytest.approx(0.6)
    assert thirty_two["activation_memory_ratio_train"] == pytest.approx(0.5 / 3.0)


def event(name, start_us, duration_us, host=True, kind=""):
    return shared_prefix_timing.Event(name, host, int(start_us * 1e3), int(duration_us * 1e3), kind)


def test_host_time_is_the_wall_less_the_waits_for_the_device_and_the_profilers_cost():
    events = [
        event("aten::mm", 0, 50, kind="cpu_op"),
        event("cudaLaunchKernel", 10, 5, kind="cuda_runtime"),
        event("cudaLaunchKernel", 20, 5, kind="cuda_runtime"),
        event("cudaLaunchKernel", 30, 405, kind="cuda_runtime"),  # a full launch queue: 400 us waited
        event("cudaMemcpyAsync", 500, 20, kind="cuda_runtime"),
        event("cudaMemcpyAsync", 600, 20, kind="cuda_runtime"),
        event("cudaStreamSynchronize", 700, 1000, kind="cuda_runtime"),  # waited in full
    ]
    cut = shared_prefix_timing.split(events, wall_ms=3.0, cost_us=2.0, cuda=True)
    assert cut.wait_ms == pytest.approx(1.4)
    assert cut.profiler_ms == pytest.approx(7 * 2.0 / 1e3)
    assert cut.host_ms == pytest.approx(3.0 - 1.4 - 0.014)


def test_gpu_time_is_the_union_of_device_intervals_without_annotations():
    events = [
        event("gemm", 0, 100, host=False, kind="kernel"),
        event("norm", 50, 100, host=False, kind="kernel"),  # overlaps the gemm by 50 us: counted once
        event("Memcpy HtoD", 400, 10, host=False, kind="gpu_memcpy"),
        event("my range", 0, 1000, host=False, kind="gpu_user_annotation"),  # spans the gaps: not work
    ]
    cut = shared_prefix_timing.split(events, wall_ms=1.0, cost_us=0.0, cuda=True)
    assert cut.gpu_ms == pytest.approx(0.16)
    assert cut.kernels == 2


def test_timed_calls_stop_at_the_time_budget_once_the_fewest_are_made():
    budget = shared_prefix_timing.Repeats(repeats=5, min_repeats=2, repeat_ms=100.0)
    assert budget.more([]) and budget.more([500.0])  # fewer than the fewest
    assert not budget.more([500.0, 500.0])
    assert budget.more([10.0, 10.0, 10.0]) and not budget.more([10.0] * 5)


def test_the_table_says_oom_where_an_arm_ran_out_of_memory():
    row = {"layers": 32, "shape": "n=8 P=8192 R=512", "T": 69632, "C": 12288, "bound": 5.67,
           "packed_train_ms": 1500.0, "upstream_liger_train_ms": float("nan"),
           "upstream_liger_train_error": "OutOfMemoryError: CUDA out of memory"}
    text = shared_prefix_report.table([row], ("upstream_liger",))
    assert "| OOM |" in text and "ours packed vs upstream_liger" in text


def test_the_liger_arm_without_liger_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as on a machine without liger-kernel
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(shared_prefix_arms.BaselineUnavailable, match="pip install liger-kernel==0.8.5"):
        shared_prefix_arms.baseline_model("upstream_liger", {}, shared_prefix_arms.TINY, 4, "cpu", None)


def test_the_liger_arm_patches_every_module_and_leaves_transformers_own_classes_behind():
    pytest.importorskip("liger_kernel", reason="liger-kernel is a GPU extra (pip install liger-kernel==0.8.5)")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as upstream

    model = shared_prefix_arms.our_model(shared_prefix_arms.TINY, 4, "cpu", torch.float32)
    state = model.state_dict()
    twin = shared_prefix_arms.baseline_model("upstream_liger", state, shared_prefix_arms.TINY, 4, "cpu", torch.float32)
    assert shared_prefix_arms.liger_modules(twin) == {
        "rms_norm": (4 * 2 + 1 * 2 + 1, 4 * 2 + 1 * 2 + 1),  # two per layer, q/k norms of the full layer, final
        "swiglu": (4, 4),
        "fused_linear_cross_entropy": (1, 1),
    }
    assert upstream.Qwen3_5RMSNorm.__module__ == upstream.Qwen3_5MLP.__module__ == upstream.__name__
    plain = shared_prefix_arms.baseline_model("upstream", state, shared_prefix_arms.TINY, 4, "cpu", torch.float32)
    assert shared_prefix_arms.liger_modules(plain)["rms_norm"][0] == 0
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in state.items())


def test_plots_draw_efficiency_host_gpu_and_baselines_per_depth(tiny_run, tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need the bench extra (pip install -e '.[bench]')")
    import plot_shared_prefix

    written = plot_shared_prefix.main([str(tiny_run / "shared_prefix_cpu-tiny.csv"), "--out", str(tmp_path)])
    assert {p.name for p in written} >= {"shared_prefix_cpu-tiny_efficiency.png", "shared_prefix_cpu-tiny_host_gpu.png"}
    assert all(p.stat().st_size > 0 for p in written)


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


def test_gradient_bytes_count_each_gradient_storage_once():
    tied = torch.nn.Linear(4, 3, bias=True)
    model = torch.nn.ModuleDict({"a": tied, "b": torch.nn.Linear(4, 3, bias=False)})
    model["b"].weight = tied.weight  # tied: one parameter, one gradient
    assert shared_prefix_timing.gradient_bytes(model) == 0
    model["a"](torch.ones(2, 4)).sum().backward()
    assert shared_prefix_timing.gradient_bytes(model) == (4 * 3 + 3) * 4
    model["b"].weight.grad = None
    assert shared_prefix_timing.gradient_bytes(model) == 3 * 4


def test_the_sync_debug_modes_prototype_notice_is_not_a_sync():
    notice = ("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
              "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)")
    assert not shared_prefix_timing.is_sync(notice)
    assert shared_prefix_timing.is_sync("called a synchronizing CUDA operation")


def test_a_graphs_run_has_the_graphs_plot_and_only_that(tmp_path):
    import plot_shared_prefix

    path = tmp_path / "grid.csv"
    keys = ["layers", "shape", "efficiency_shared_graphs_train", "efficiency_shared_graphs_logprob",
            "efficiency_shared_graphs_logprob_reuse"]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(keys)
        writer.writerows([["8", "n=4 P=2048 R=256", "0.91", "0.84", "0.91"], ["8", "n=8 P=4096 R=256", "0.95", "0.82", "0.87"]])
    rows = list(csv.DictReader(path.open()))
    drawn = {name for name in plot_shared_prefix.PLOTS if plot_shared_prefix.present(rows, name)}
    assert drawn == {"graphs"}  # nothing else has its columns in this CSV
    assert [label for _, label in plot_shared_prefix.present(rows, "graphs")] == [
        "training step", "log-prob pass, one call", "log-prob pass, plan reused"]
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra: the PNG itself
        assert [p.name for p in plot_shared_prefix.main([str(path)])] == ["grid_graphs.png"]


def test_the_gpu_bench_takes_the_compact_ladder_for_its_run(monkeypatch):
    from patchgen.kernels.shared_prefix import bucket

    monkeypatch.setattr(bucket, "COMPACT_RATIO", bucket.COMPACT_RATIO)  # restored after the test
    shared_prefix_gpu.parse_args(["--tiny", "--compact-ladder", "33/32"])
    assert bucket.COMPACT_RATIO == (33, 32)
    with pytest.raises(SystemExit, match="--compact-ladder"):
        shared_prefix_gpu.parse_args(["--tiny", "--compact-ladder", "1/1"])
