"""`bench/shared_prefix_gpu.py --graphs` on the CPU: the two arms (shared step without checkpointing,
eager and graphed, and their log-prob passes) land in the shape's row with their times, the graphs'
counters and whether the graphed loss and log-probs equal the eager ones; the model goes back to checkpointing and drops its graphs after.
The graphs run as `EagerReplay` here (CUDA graphs need CUDA; the bench refuses --graphs --tiny)."""

import pathlib
import sys

import pytest
import torch
from patchgen.kernels.graphs import EagerReplay
from patchgen.kernels.modeling import layer_graphs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import shared_prefix_gpu
from shared_prefix_graphs import graph_arms
from shared_prefix_graphs import summary as shared_prefix_graphs_summary


def test_graph_arms_fill_the_row(monkeypatch):
    monkeypatch.setattr(layer_graphs, "DEFAULT_REPLAY", EagerReplay)
    args = shared_prefix_gpu.parse_args(["--tiny", "--layers", "4", "--shapes", "n4", "--host-split", ""])
    args.graphs, args.repeats, args.min_repeats, args.repeat_ms = True, 2, 1, 0.0
    device = torch.device("cpu")
    model = shared_prefix_gpu.our_model(shared_prefix_gpu.TINY, 4, device, torch.float32)
    shape = shared_prefix_gpu.tiny_shapes("n4")[0]
    row, inputs = shared_prefix_gpu.shape_row(shape, 4, shared_prefix_gpu.TINY["vocab_size"], device)
    row["packed_train_ms"], row["packed_logprob_ms"] = 100.0, 50.0  # the packed arm's times, as `speed` measures them first
    graph_arms(model, row, inputs, args, device, shared_prefix_gpu.Timer(device), float("nan"),
               shared_prefix_gpu.run_arm)
    assert row["shared_eager_train_ms"] > 0 and row["shared_graphs_train_ms"] > 0
    assert row["graphs_loss_bitequal"] is True and row["graphs_logprobs_bitequal"] is True
    # one training and one scoring capture (each arm's warm-up call), the timed calls replay
    assert row["graphs_captures"] == 2 and row["graphs_replays"] >= 2
    assert row["efficiency_shared_graphs_train"] == pytest.approx(100.0 / row["shared_graphs_train_ms"] / row["bound"])
    assert row["efficiency_shared_graphs_logprob"] == pytest.approx(50.0 / row["shared_graphs_logprob_ms"] / row["bound"])
    summary = shared_prefix_graphs_summary(row)
    assert f"2 captures / {row['graphs_replays']} replays, loss bit-equal to eager True" in summary
    assert "bit-equal to eager True;" in summary.split("log-probs:")[1]
    # the reuse figure: the same batch's graphed log-prob pass with its plan kept from an earlier pass
    assert row["shared_graphs_logprob_reuse_ms"] > 0
    # the figure is the reuse case only when every timed call was handed the kept plan (a shared pass, not packed)
    assert row["plan_reuse_hits"] == row["plan_reuse_calls"] >= 1
    assert row["efficiency_shared_graphs_logprob_reuse"] == pytest.approx(50.0 / row["shared_graphs_logprob_reuse_ms"] / row["bound"])
    assert f"plan reused {row['shared_graphs_logprob_reuse_ms']:.0f} ms" in summary
    assert layer_graphs.graphs_of(model) is None and not model.config.shared_prefix_cuda_graphs
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_graphs_are_refused_in_the_tiny_cpu_run():
    with pytest.raises(SystemExit, match="--graphs needs a CUDA device"):
        shared_prefix_gpu.parse_args(["--tiny", "--graphs"])


def test_varied_micro_batches_fill_the_row(monkeypatch):
    """`--graphs --vary N`: N micro-batches of drawn lengths, eager then graphed; the graphs pad to buckets,
    so fewer than N capture, and the graphed losses match the eager ones up to float32 rounding."""
    from shared_prefix_vary import summary as vary_summary
    from shared_prefix_vary import vary_arms

    monkeypatch.setattr(layer_graphs, "DEFAULT_REPLAY", EagerReplay)
    args = shared_prefix_gpu.parse_args(["--tiny", "--layers", "4", "--shapes", "n4", "--host-split", ""])
    args.graphs, args.vary, args.vary_prompt, args.vary_response = True, 6, 0.1, 0.5
    device = torch.device("cpu")
    model = shared_prefix_gpu.our_model(shared_prefix_gpu.TINY, 4, device, torch.float32)
    shape = shared_prefix_gpu.tiny_shapes("n4")[0]
    row = {"layers": 4, "shape": shape[0]}
    vary_arms(model, shape, row, args, device, shared_prefix_gpu.TINY["vocab_size"])
    assert row["vary_steps"] == 6 and row["vary_captures"] + row["vary_replays"] == 6
    assert 1 <= row["vary_captures"] < 6
    assert row["vary_eager_ms"] > 0 and row["vary_graphs_ms"] > 0 and row["vary_padding"] > 1.0
    assert row["vary_loss_rel_diff"] < 1e-5
    assert f"{row['vary_captures']} captures" in vary_summary(row)
    # the auto arm: every step a capture, a replay or an eager step; eager steps once a replay was measured
    assert row["vary_auto_captures"] + row["vary_auto_replays"] + row["vary_auto_eager"] == 6
    assert row["vary_auto_eager"] >= 1 and row["vary_auto_ms"] > 0 and "train eager" in row["vary_auto_choice"]
    assert layer_graphs.graphs_of(model) is None and not model.config.shared_prefix_cuda_graphs
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_vary_needs_the_graphs():
    with pytest.raises(SystemExit, match="--vary varies the --graphs arms"):
        shared_prefix_gpu.parse_args(["--vary", "4"])


def test_a_graphs_cache_needs_the_graphs_and_one_graph_or_more():
    with pytest.raises(SystemExit, match="--graphs-cache 0: give a count of 1 or more"):
        shared_prefix_gpu.parse_args(["--graphs", "--graphs-cache", "0"])
    with pytest.raises(SystemExit, match="with --graphs"):
        shared_prefix_gpu.parse_args(["--graphs-cache", "1"])
