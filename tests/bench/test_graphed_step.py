"""`bench/graphed_step.py` and its static layer stack, on the CPU: the stack a CUDA graph would capture
computes the model's own step, and nothing inside it reads a tensor on the host."""

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import graphed_step
import static_stack
from shared_prefix_arms import TINY, our_model
from shared_prefix_shapes import TINY_SHAPES, shape_batch

SHAPE = TINY_SHAPES["n4"]  # 4 rollouts of a 192-token prompt + one unrelated sequence


@pytest.fixture(scope="module")
def model():
    return graphed_step.uncheckpointed(our_model(TINY, 4, torch.device("cpu"), torch.float32))


@pytest.fixture(scope="module")
def inputs():
    ids, cu, max_len, _ = shape_batch(SHAPE, TINY["vocab_size"], torch.device("cpu"))
    return ids, cu, max_len


def _steps(model, inputs, shared: bool):
    model.config.shared_prefix_training = shared
    ids, cu, max_len = inputs
    batch = static_stack.probe(model, ids, cu, max_len)
    stack = static_stack.stack_of(model, batch)
    own = graphed_step.two_micro_batches(model, lambda **kw: static_stack.model_step(model, ids, cu, max_len, **kw))
    static = graphed_step.two_micro_batches(model, lambda **kw: static_stack.static_step(model, stack, batch, **kw))
    model.config.shared_prefix_training = False
    return batch, own, static


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared"])
def test_the_static_stack_step_equals_the_models_own_step_bit_for_bit(model, inputs, shared):
    batch, own, static = _steps(model, inputs, shared)
    equal, diff, where = graphed_step.compare(own, static)
    assert equal, f"max |d grad| {diff} at {where}"
    assert len(own[1]) == len(list(model.parameters()))  # every parameter got a gradient, and was compared


def test_the_probe_records_the_plan_and_the_compact_row_of_a_shared_step(model, inputs):
    batch, _, _ = _steps(model, inputs, shared=True)
    assert batch.plan is not None
    assert batch.embed_ids.shape[1] == batch.plan.compact_length < inputs[0].shape[1]
    assert all(kw[static_stack.PLAN] is batch.plan for kw in batch.layer_kwargs)


def test_the_probe_records_the_packed_row_of_a_packed_step(model, inputs):
    batch, _, _ = _steps(model, inputs, shared=False)
    assert batch.plan is None
    assert torch.equal(batch.embed_ids, inputs[0])
    assert all(kw["cu_seq_lens_q"] is inputs[1] for kw in batch.layer_kwargs)


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared"])
def test_nothing_inside_the_layer_stack_reads_a_tensor_on_the_host(model, inputs, shared):
    model.config.shared_prefix_training = shared
    batch = static_stack.probe(model, *inputs)
    model.config.shared_prefix_training = False
    assert graphed_step.stack_host_syncs(model, batch, torch.device("cpu")).startswith("none")


def test_the_host_read_check_finds_a_read_inside_a_layer(model, inputs, monkeypatch):
    batch = static_stack.probe(model, *inputs)
    layer = model.model.layers[0]
    forward = layer.forward

    def reading(hidden, *args, **kwargs):
        hidden.sum().item()
        return forward(hidden, *args, **kwargs)

    monkeypatch.setattr(layer, "forward", reading)
    assert "item" in graphed_step.stack_host_syncs(model, batch, torch.device("cpu"))


def test_kept_gradients_stay_the_same_buffers_from_step_to_step(model, inputs):
    static_stack.zero_grads(model)
    before = {n: p.grad for n, p in model.named_parameters()}
    static_stack.model_step(model, *inputs)
    static_stack.model_step(model, *inputs, zero=True)
    assert all(p.grad is before[n] for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)


def test_the_script_reports_every_arm_and_skips_the_graph_off_cuda(capsys):
    rows = graphed_step.main(["--tiny", "--layers", "4", "--repeats", "1", "--warmup", "0", "--no-ckpt"])
    assert [row["arm"] for row in rows] == ["packed", "shared"]
    assert all(row["static_equal"] and row["stack_syncs"].startswith("none") for row in rows)
    assert all(row["graphed_error"].startswith("skipped") for row in rows)
    out = capsys.readouterr().out
    assert out.count("graphed: FAILED skipped") == 2 and "static == model's own step: yes" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arms", "packed,tree"], "--arms: unknown tree"),
        (["--layers", "8,8"], "--layers"),
        (["--shape", "4x2048x256,split"], "--shape: give one shape"),
        (["--shape", "4x2048"], "--shapes: cannot read"),
    ],
)
def test_bad_arguments_say_what_is_wrong(argv, message):
    with pytest.raises(SystemExit, match=message):
        graphed_step.parse_args(argv)


def test_the_granularity_is_stack_or_layer():
    assert graphed_step.parse_args(["--granularity", "layer"]).granularity == "layer"
    with pytest.raises(SystemExit):
        graphed_step.parse_args(["--granularity", "model"])
