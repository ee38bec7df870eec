"""`bench/scoring_loop.py` at tiny widths on the CPU: every arm runs, host rows score as device rows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import scoring_loop


def test_the_loop_times_every_arm_and_host_rows_score_as_device_rows():
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "2", "--repeats", "1"])
    assert (row["T"], row["C"]) == (4 * 160, 128 + 4 * 32)
    for arm in ("packed", "shared"):
        assert row[f"{arm} host rows bit-equal"] is True
        assert row[f"{arm} device rows ms"] > 0 and row[f"{arm} host rows ms"] > 0
    assert 0 < row["shared host rows host ms"] <= row["shared host rows ms"] * 1.001
    assert row["efficiency host rows"] == row["packed host rows ms"] / row["shared host rows ms"] / (640 / 256)


def test_response_labels_score_the_last_tokens_of_each_sequence_only():
    import torch

    ids = torch.arange(10, 20).unsqueeze(0)
    cu = torch.tensor([0, 6, 10])
    labels = scoring_loop.response_labels(ids, cu, 2)
    # sequence [10..15]: positions 3 and 4 predict 14 and 15; sequence [16..19]: positions 7 and 8 predict 18, 19
    assert labels.tolist() == [[-100, -100, -100, 14, 15, -100, -100, 18, 19, -100]]


def test_the_labelled_loop_scores_as_the_trainer_does():
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "2", "--repeats", "1",
                                "--labels"])
    assert row["packed host rows bit-equal"] is True and row["shared host rows bit-equal"] is True


def test_the_eager_arm_scores_as_the_shared_one_off_cuda():
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "2", "--repeats", "1",
                                "--eager"])
    assert row["shared eager host rows ms"] > 0 and "shared eager device rows ms" not in row
    assert row["shared eager bit-equal to shared"] is True  # off CUDA neither arm graphs nor pads
    assert row["efficiency eager host rows"] == row["packed host rows ms"] / row["shared eager host rows ms"] / (640 / 256)


def test_the_idle_report_blames_each_gap_on_the_call_and_phase_the_host_was_in():
    from shared_prefix_timing import Event

    ms = 1_000_000

    def host(name, start, length, kind="user_annotation"):
        return Event(name, True, int(start * ms), int(length * ms), kind)

    def kernel(start, length):
        return Event("kernel", False, int(start * ms), int(length * ms), "kernel")

    events = [
        host("phase: model", 0, 4), host("phase: plan", 0.5, 2.5), host("aten::to", 1.0, 0.5, "cpu_op"),
        kernel(0.0, 0.5), kernel(3.0, 5.0),  # call 0: the device waits 2.5 ms for the plan
        host("phase: model", 4, 2), host("phase: positions", 4.2, 0.3),
        kernel(8.0, 1.0), kernel(9.5, 1.0),  # call 1 was queued in time; a 0.5 ms gap while its positions ran
    ]
    events.append(host("phase: positions", 8.9, 0.7))
    report = scoring_loop.idle_report(events, 2, "t")
    lines = report.splitlines()
    assert "for 2 calls, device busy 7.50 ms" in lines[0] and "idle in gaps >= 10 us: 3.00 ms (1.50 a call)" in lines[0]
    assert lines[1] == "  device ms by kind (summed, overlaps counted twice): kernel 7.50"
    assert lines[3].split()[:4] == ["2.50", "1", "2.50", "plan"]  # the most idle first
    assert lines[4].split()[:4] == ["0.50", "1", "0.50", "positions"]
    assert longest_gaps(lines)[0].split()[:5] == ["call", "0", "0.50", "2.50", "plan"]
    assert longest_gaps(lines)[1].split()[:5] == ["call", "1", "5.00", "0.50", "positions"]  # 5 ms into call 1
    inside = report.split("during the longest gap")[1]
    assert "aten::to" in inside and "phase: plan" in inside


def longest_gaps(lines):
    at = lines.index("  longest gaps: call of the loop, ms into it, length ms, host phase / CUDA call")
    return [line for line in lines[at + 1 :] if line.startswith("    call ")]


def test_the_collector_is_off_inside_a_gc_off_loop_only(monkeypatch):
    import gc

    monkeypatch.setattr(scoring_loop, "GC_OFF", False)  # main sets it; restored after the test
    seen = []
    real = scoring_loop._loop_ms
    monkeypatch.setattr(scoring_loop, "_loop_ms", lambda *a: (seen.append(gc.isenabled()), real(*a))[1])
    scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "2x64x16", "--batches", "1", "--repeats", "1", "--gc-off"])
    assert seen and not any(seen) and gc.isenabled()



def test_a_collection_of_garbage_is_counted_and_shows_in_the_profile():
    import gc

    from shared_prefix_timing import events_of
    from torch.profiler import ProfilerActivity, profile

    gc.disable()  # no automatic collection besides the one asked for (the callbacks still see that one)
    try:
        with scoring_loop.collections() as seen, profile(activities=[ProfilerActivity.CPU]) as prof:
            gc.collect(1)
    finally:
        gc.enable()
    assert list(seen) == [1] and len(seen[1]) == 1 and seen[1][0] >= 0
    assert "gc: generation 1" in {e.name for e in events_of(prof)}
    assert all(cb.__module__ != "scoring_loop" for cb in gc.callbacks)  # removed after the block


def test_the_timeline_refuses_to_run_without_a_device():
    import pytest

    with pytest.raises(SystemExit, match="needs a CUDA device"):
        scoring_loop.main(["--tiny", "--timeline"])


def test_a_compact_ladder_ab_sets_the_buckets_ratio_and_refuses_a_bad_one(monkeypatch):
    import pytest
    from patchgen.kernels.shared_prefix import bucket

    monkeypatch.setattr(bucket, "COMPACT_RATIO", bucket.COMPACT_RATIO)  # restored after the test
    scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "2x64x16", "--batches", "1", "--repeats", "1",
                       "--compact-ladder", "33/32"])
    assert bucket.COMPACT_RATIO == (33, 32)
    assert bucket.rung(6146, bucket.COMPACT_RATIO) == 6222  # 1.2 % padding rows where 17/16 gives 6277 (2.1 %)
    for bad in ("32/33", "x/2", "17"):
        with pytest.raises(SystemExit, match="--compact-ladder"):
            scoring_loop.main(["--tiny", "--compact-ladder", bad])


def test_the_loops_device_time_is_summed_per_kernel_with_copies_under_their_kind():
    from shared_prefix_timing import Event

    events = [
        Event("nvjet_a", False, 0, 2000, "kernel"), Event("nvjet_a", False, 5000, 3000, "kernel"),
        Event("Memcpy HtoD (Pinned -> Device)", False, 9000, 500, "gpu_memcpy"),
        Event("phase: model", True, 0, 9000, "user_annotation"), Event("aten::mm", True, 0, 100, "cpu_op"),
    ]
    assert scoring_loop.kernel_us(events) == {"nvjet_a": 5.0, "gpu_memcpy: Memcpy HtoD (Pinned -> Device)": 0.5}
    # a torch whose records carry no kind (the H200 image's): read off the runtime's names, kernels unprefixed
    unkinded = [Event(e.name, e.host, e.start_ns, e.duration_ns, "" if not e.host else e.kind) for e in events]
    assert scoring_loop.kernel_us(unkinded) == scoring_loop.kernel_us(events)


def test_the_timeline_sets_the_loops_op_groups_shared_against_packed(monkeypatch):
    import argparse
    import importlib

    import torch
    from shared_prefix_arms import MODULE, config_for
    from shared_prefix_shapes import parse_shapes

    profiled = {"packed": {"nvjet_a": 4000.0}, "shared": {"nvjet_a": 1100.0}}
    arms = iter(["packed", "shared"])
    monkeypatch.setattr(scoring_loop, "loop_timeline", lambda *a: ("report", profiled[next(arms)]))
    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    model = module.Qwen3_5ForCausalLM(config_for(scoring_loop.TINY_WIDTHS, 4)).eval()
    args = argparse.Namespace(batches=1, repeats=1, labels=False, eager=False, timeline=True, vary=False, scoring="graphs",
                              host_split=False, chunk_aligned="off")
    (shape,) = parse_shapes("4x128x32")
    result = scoring_loop.measure_shape(model, shape, args, torch.device("cpu"), module)
    reports = result["timelines"]
    assert reports[:2] == ["report", "report"]
    groups = reports[2].splitlines()
    assert groups[0] == "--- n=4 P=128 R=32: the loop's device time per op group"
    gemm = next(line for line in groups if line.startswith("GEMMs"))
    assert gemm.split()[-4:] == ["4.00", "1.10", "0.275", "-0.50"]  # C/T = 256 / 640: 1.1 ms - 0.4 x 4 ms


def test_a_varied_loop_draws_a_layout_per_call_and_bounds_by_the_loops_means():
    """`--vary`: every micro-batch has its own prompt and response lengths (RL's case: the graphs meet a new layout
    every call); T and C are the loop's means, so the bound is its total tokens over its total compact rows."""
    import statistics

    on_device, on_host = scoring_loop.micro_batches(scoring_loop.parse_shapes("4x128x32")[0], 3, 1000, "cpu", vary=True)
    lengths = [row[1].diff().tolist() for row in on_host]
    assert len({tuple(x) for x in lengths}) == 3  # three layouts
    assert all(torch_equal(a, b) for d, h in zip(on_device, on_host) for a, b in zip(d[:2], h[:2]))
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "3", "--repeats", "1",
                                "--vary"])
    drawn = scoring_loop.micro_batches(scoring_loop.parse_shapes("4x128x32")[0], 3, 1000, "cpu", vary=True)[1]
    tokens = [int(ids.shape[1]) for ids, *_ in drawn]
    assert row["T"] == statistics.mean(tokens)  # the same draw (seeded) as the loop's
    assert row["C"] < row["T"] and row["shared host rows bit-equal"] is True


def test_a_varied_loop_refuses_what_it_cannot_vary():
    import pytest

    with pytest.raises(SystemExit, match="--labels"):
        scoring_loop.main(["--tiny", "--vary", "--labels"])
    with pytest.raises(SystemExit, match="multi-turn"):
        scoring_loop.main(["--tiny", "--layers", "4", "--vary", "--shapes", "agentic"])


def torch_equal(a, b):
    import torch

    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_a_mixed_loop_draws_each_micro_batch_from_one_of_the_shapes():
    """`--mix`: one loop over micro-batches of very different sizes (prompts of an RL dataset), for "auto"'s chooser
    to meet them in one model; T and C are the loop's means."""
    import pytest

    shapes = scoring_loop.parse_shapes("2x64x16,4x128x32")
    _, on_host = scoring_loop.mixed_batches(shapes, 6, 1000, "cpu")
    tokens = [int(ids.shape[1]) for ids, *_ in on_host]
    assert set(tokens) == {2 * 80, 4 * 160} and len(tokens) == 6
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "2x64x16,4x128x32", "--batches", "6",
                                "--repeats", "1", "--mix"])
    assert row["shape"] == "mix of n=2 P=64 R=16 + n=4 P=128 R=32"
    assert row["T"] == sum(tokens) / 6 and row["shared host rows bit-equal"] is True
    with pytest.raises(SystemExit, match="--mix draws from two or more"):
        scoring_loop.main(["--tiny", "--shapes", "2x64x16", "--mix"])


def test_the_loop_plot_reads_what_the_loop_prints(capsys, tmp_path):
    import importlib.util

    import plot_scoring_loop

    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x64x16", "--batches", "1", "--repeats", "1"])
    out = tmp_path / "loop.txt"
    out.write_text("some other output\n" + capsys.readouterr().out)
    (found,) = plot_scoring_loop.results(out.read_text())
    assert (found["layers"], found["shape"]) == (4, "n=4 P=64 R=16")
    assert found["host_eff"] == round(row["efficiency host rows"], 2)
    assert found["device_shared"] == round(row["shared device rows ms"], 1)
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra: the PNG itself
        png = plot_scoring_loop.main([f"tiny={out}", f"again={out}", "--out", str(tmp_path / "loop.png")])
        assert png.stat().st_size > 0


def test_the_host_split_times_each_phase_and_layer_per_forward_and_restores_the_functions():
    from patchgen.kernels.modeling import scoring_layers

    replayed = scoring_layers._replayed
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "3", "--repeats", "1",
                                "--host-split"])
    assert scoring_layers._replayed is replayed
    shared = next(text for text in row["timelines"] if "shared, host rows: host ms per forward" in text)
    per_forward = {}
    for line in shared.splitlines()[2:]:
        ms, calls, _, label = line.split(maxsplit=3)
        per_forward[label] = (float(ms), float(calls))
    assert "(inclusive; 3 forwards)" in shared
    assert per_forward["model"][1] == 1.0 and per_forward["plan"][1] == 1.0
    # every micro-batch its own ids: each plan built, its parts inside it
    assert per_forward["plan part: built (not reused)"][1] == 1.0
    assert per_forward["plan part: upload"][0] <= per_forward["plan part: built (not reused)"][0] <= per_forward["plan"][0]
    assert per_forward["plan part: prefix tree"][1] == 1.0
    # off CUDA no layer replays: all four run as they are, inside the layer stack, inside the model
    assert per_forward["layer: eager (first of a kind, or as it is)"][1] == 4.0
    assert per_forward["layer: eager (first of a kind, or as it is)"][0] <= per_forward["layer stack"][0]
    assert per_forward["layer stack"][0] <= per_forward["model"][0]


def test_the_min_calls_ab_sets_the_capture_rule_and_refuses_below_one(monkeypatch):
    import pytest
    from patchgen.kernels.shared_prefix import call_graphs

    monkeypatch.setattr(call_graphs, "MIN_CALLS_TO_CAPTURE", call_graphs.MIN_CALLS_TO_CAPTURE)
    scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "2x64x16", "--batches", "1", "--repeats", "1",
                       "--min-calls", "1"])
    assert call_graphs.MIN_CALLS_TO_CAPTURE == 1
    with pytest.raises(SystemExit, match="below 1"):
        scoring_loop.main(["--tiny", "--min-calls", "0"])


def test_the_first_calls_ab_sets_whether_a_first_layer_is_captured(monkeypatch):
    from patchgen.kernels.shared_prefix import call_graphs

    monkeypatch.setattr(call_graphs, "CAPTURE_FIRST_CALLS", True)
    scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "2x64x16", "--batches", "1", "--repeats", "1",
                       "--first-calls", "eager"])
    assert call_graphs.CAPTURE_FIRST_CALLS is False


def _noting_alignment(measure, seen):
    def measured(model, *args, **kwargs):
        found = measure(model, *args, **kwargs)
        seen.append(model.config.shared_prefix_chunk_aligned)
        return found

    return measured


def test_the_capture_rule_ab_runs_each_way_in_turn_in_one_process(monkeypatch):
    import capture_rule_ab
    import pytest
    from patchgen.kernels.shared_prefix import call_graphs

    monkeypatch.setattr(call_graphs, "MIN_CALLS_TO_CAPTURE", call_graphs.MIN_CALLS_TO_CAPTURE)
    monkeypatch.setattr(call_graphs, "CAPTURE_FIRST_CALLS", call_graphs.CAPTURE_FIRST_CALLS)
    loop = ["--", "--tiny", "--layers", "4", "--shapes", "2x64x16", "--batches", "1", "--repeats", "1"]
    runs = capture_rule_ab.main(["--ways", "1,3", "--rounds", "2", *loop])
    assert [way for way, _ in runs] == ["1", "3", "1", "3"]
    assert all(len(rows) == 1 and rows[0]["shared host rows ms"] > 0 for _, rows in runs)
    assert call_graphs.MIN_CALLS_TO_CAPTURE == 3
    runs = capture_rule_ab.main(["--option", "first-calls", "--ways", "capture,eager", "--rounds", "1", *loop])
    assert [way for way, _ in runs] == ["capture", "eager"] and call_graphs.CAPTURE_FIRST_CALLS is False
    monkeypatch.setattr(scoring_loop, "measure_shape", _noting_alignment(scoring_loop.measure_shape, seen := []))
    capture_rule_ab.main(["--option", "chunk-aligned", "--ways", "on,off", "--rounds", "1", *loop])
    assert seen == [True, False]
    with pytest.raises(SystemExit, match="--first-calls is this script's to set"):
        capture_rule_ab.main(["--option", "first-calls", "--", "--tiny", "--first-calls", "eager"])


def test_a_plan_profile_of_a_loop_that_planned_nothing_says_so():
    # a shared arm whose rows the model would not share (`verify.sharing_allowed`) never calls plan_for: the loop's
    # other timelines are kept, not lost to pstats' refusal of an empty profile
    from host_split import profiled

    with profiled("plan") as report:
        pass
    assert "plan_for under cProfile: no call" in report()


def test_the_plan_profile_counts_every_plan_of_the_shared_loop_and_restores_plan_for():
    from patchgen.kernels.modeling import shared_prefix

    real = shared_prefix.plan_for
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "3", "--repeats", "1",
                                "--host-split", "--plan-profile"])
    assert shared_prefix.plan_for is real
    (profile,) = [text for text in row["timelines"] if "plan_for under cProfile" in text]
    assert "(3 calls;" in profile and "build_plan" in profile


def test_a_profile_of_a_method_restores_it_and_counts_its_calls():
    # `--profile-in replay` wraps a class's method (`Tape.replay`): the class gets its own function back, and the
    # report divides by the calls the wrapper saw
    from host_split import profiled
    from patchgen.kernels.shared_prefix.graph_tape import Tape

    real = Tape.__dict__["replay"]
    with profiled("replay") as report:
        assert Tape.__dict__["replay"] is not real
        tape = Tape(None, None)
        tape.replay()
        tape.replay()
    assert Tape.__dict__["replay"] is real
    assert "Tape.replay under cProfile (2 calls;" in report()


def test_the_placeholder_scan_ab_swaps_the_tapes_scan_and_puts_it_back(monkeypatch):
    # the fifteenth session's A/B needs both ways in one process: the pytree way must check and hand over the same
    # arguments as the plain scan, read the weight's metadata through the placeholder, and the plain way restore
    # graph_tape.py's own functions
    import threading

    import capture_rule_ab
    import torch
    from patchgen.kernels.shared_prefix import graph_tape

    own = (graph_tape._real, graph_tape._placeholders, graph_tape.Tape.linear)
    for name, value in zip(("_real", "_placeholders"), own):
        monkeypatch.setattr(graph_tape, name, value)
    monkeypatch.setattr(graph_tape.Tape, "linear", own[2])
    loop = ["--", "--tiny", "--layers", "4", "--shapes", "2x64x16", "--batches", "1", "--repeats", "1"]
    capture_rule_ab.main(["--option", "placeholder-scan", "--ways", "pytree", "--rounds", "1", *loop])
    assert (graph_tape._real, graph_tape._placeholders) != own[:2] and graph_tape.Tape.linear is not own[2]

    class Recorder:
        thread = threading.get_ident()

    weight = torch.randn(3, 2)
    held = graph_tape.placeholder(weight, Recorder(), at=0)
    args = ([held, 1], held)
    assert [type(x) for x in graph_tape._real(args)[0]] == [torch.Tensor, int]
    assert graph_tape._placeholders(args, {"w": held}) == [held, held, held]

    reads = []
    real_tf = graph_tape.Placeholder.__torch_function__.__func__

    def noting(cls, func, types, args=(), kwargs=None):
        reads.append(func)
        return real_tf(cls, func, types, args, kwargs)

    monkeypatch.setattr(graph_tape.Placeholder, "__torch_function__", classmethod(noting))
    tape = graph_tape.Tape(None, None, graph_type=None)
    monkeypatch.setattr(graph_tape.Tape, "_end", lambda self: None)
    monkeypatch.setattr(graph_tape.Tape, "_begin", lambda self: None)
    tape.thread = threading.get_ident()
    out = graph_tape.Tape.linear(tape, torch.randn(1, 4, 2), held)
    assert out.shape == (1, 4, 3) and len(reads) == 3  # the old tape's three reads through the placeholder

    capture_rule_ab.main(["--option", "placeholder-scan", "--ways", "plain", "--rounds", "1", *loop])
    assert (graph_tape._real, graph_tape._placeholders, graph_tape.Tape.linear) == own
