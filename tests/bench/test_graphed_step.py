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
from shared_prefix_shapes import Shape, shape_batch

SHAPE = Shape("small", [(3, 80, 12)], [24])  # 3 rollouts of an 80-token prompt + one unrelated sequence


@pytest.fixture(scope="module")
def model():
    return graphed_step.uncheckpointed(our_model(TINY, 4, torch.device("cpu"), torch.float32))


@pytest.fixture(scope="module")
def inputs():
    ids, cu, max_len, _ = shape_batch(SHAPE, TINY["vocab_size"], torch.device("cpu"))
    return ids, cu, max_len


@pytest.fixture(scope="module")
def steps(model, inputs):
    """Per arm (computed once): the probe's record, and the model's own and the static step's (loss, gradients)."""
    done = {}

    def run(shared: bool):
        if shared not in done:
            model.config.shared_prefix_training = shared
            ids, cu, max_len = inputs
            batch = static_stack.probe(model, ids, cu, max_len)
            stack = static_stack.stack_of(model, batch)
            own = graphed_step.two_micro_batches(
                model, lambda **kw: static_stack.model_step(model, ids, cu, max_len, **kw)
            )
            static = graphed_step.two_micro_batches(
                model, lambda **kw: static_stack.static_step(model, stack, batch, **kw)
            )
            model.config.shared_prefix_training = False
            done[shared] = batch, own, static
        return done[shared]

    return run


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared"])
def test_the_static_stack_step_equals_the_models_own_step_bit_for_bit(model, steps, shared):
    _, own, static = steps(shared)
    equal, diff, where = graphed_step.compare(own, static)
    assert equal, f"max |d grad| {diff} at {where}"
    assert len(own[1]) == len(list(model.parameters()))  # every parameter got a gradient, and was compared


def test_the_probe_records_the_plan_and_the_compact_row_of_a_shared_step(steps, inputs):
    batch, _, _ = steps(True)
    assert batch.plan is not None
    assert batch.embed_ids.shape[1] == batch.plan.compact_length < inputs[0].shape[1]
    assert all(kw[static_stack.PLAN] is batch.plan for kw in batch.layer_kwargs)


def test_the_probe_records_the_packed_row_of_a_packed_step(steps, inputs):
    batch, _, _ = steps(False)
    assert batch.plan is None
    assert torch.equal(batch.embed_ids, inputs[0])
    assert all(kw["cu_seq_lens_q"] is inputs[1] for kw in batch.layer_kwargs)


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared"])
def test_nothing_inside_the_layer_stack_reads_a_tensor_on_the_host(model, steps, shared):
    batch, _, _ = steps(shared)
    assert graphed_step.stack_host_syncs(model, batch, torch.device("cpu")).startswith("none")


def test_the_host_read_check_finds_a_read_inside_a_layer(model, steps, monkeypatch):
    batch, _, _ = steps(True)
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


def test_the_script_checks_an_arm_and_says_the_graph_needs_cuda(capsys):
    argv = ["--tiny", "--shape", "3x80x12", "--layers", "4", "--repeats", "1", "--warmup", "0", "--no-ckpt"]
    rows = graphed_step.main(argv + ["--arms", "shared"])
    assert [row["arm"] for row in rows] == ["shared"]
    assert rows[0]["static_equal"] and rows[0]["stack_syncs"].startswith("none")
    assert rows[0]["graphed_stack_error"].startswith("skipped")
    out = capsys.readouterr().out
    assert (
        "graphed_stack: FAILED skipped: CUDA graphs need a CUDA device" in out
        and "static == model's own step: yes" in out
    )


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


def test_the_granularity_is_stack_or_layer_or_both():
    assert graphed_step.parse_args(["--granularity", "stack,layer"]).granularity == ["stack", "layer"]
    with pytest.raises(SystemExit, match="--granularity: unknown model"):
        graphed_step.parse_args(["--granularity", "model"])


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_what_is_handed_to_the_capture_computes_the_same_step(model, steps, granularity, monkeypatch):
    # make_graphed_callables needs CUDA: here it hands the callables back, so the chain around them is checked
    handed = {}

    def hand_back(callables, sample_args, num_warmup_iters):
        handed["callables"], handed["samples"] = callables, sample_args
        return callables

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", hand_back)
    batch, own, _ = steps(True)
    stack = graphed_step.graphed_stack(model, batch, granularity, warmup=1)
    layers = len(model.model.layers)
    if granularity == "stack":
        assert (
            isinstance(handed["callables"], static_stack.LayerStack)
            and len(handed["callables"].layers) == layers
        )
        samples = [handed["samples"]]
    else:
        assert len(handed["callables"]) == len(handed["samples"]) == layers
        samples = handed["samples"]
    assert all(s[0].requires_grad and s[1] is batch.cos and s[2] is batch.sin for s in samples)
    model.config.shared_prefix_training = True
    result = graphed_step.two_micro_batches(
        model, lambda **kw: static_stack.static_step(model, stack, batch, **kw)
    )
    model.config.shared_prefix_training = False
    assert graphed_step.compare(own, result)[0]


def test_a_failure_is_described_by_the_op_outside_torch_that_raised_it():
    def launch_inside_a_layer():
        torch.empty(2).view(3)  # fails inside torch; the frame named is this one

    try:
        launch_inside_a_layer()
    except RuntimeError as error:
        text = graphed_step.describe(error)
    assert text.startswith("RuntimeError: shape '[3]' is invalid")
    assert "launch_inside_a_layer: torch.empty(2).view(3)" in text
