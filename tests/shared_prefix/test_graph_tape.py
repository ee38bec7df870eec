"""The pieces of a layer capture split at its linears (`shared_prefix/graph_tape.py`) that run off CUDA: a linear on a
placeholder weight is handed to the tape, any other read of that weight fails rather than compute, a tape's linear
is the eager `F.linear` bit for bit, and the generated layers record with every linear taken out (the replays,
which need CUDA graphs, in test_graph_tape_gpu.py)."""

import threading

import pytest
import torch
from patchgen.kernels.modeling import scoring_layers
from patchgen.kernels.shared_prefix import call_graphs as call_graphs_module
from patchgen.kernels.shared_prefix.graph_tape import (
    Placeholder,
    Tape,
    _capturing,
    _Linear,
    _real,
    folds,
    placeholder,
)
from torch.nn import functional as F

from tests.shared_prefix.test_scoring_layers import _batch, _eager, _LayerStandIn, _log_probs, _model


class _Recorder:
    def __init__(self):
        self.linears = []
        self.thread = threading.get_ident()  # a tape recording in this thread

    def linear(self, x, weight):
        self.linears.append((x, weight.at))
        return torch.zeros(*x.shape[:-1], weight.shape[0])


def test_a_linear_on_a_placeholder_goes_to_the_tape_and_other_reads_of_it_fail():
    tape, weight = _Recorder(), torch.randn(6, 4)
    held = placeholder(weight, tape, at=3)
    x = torch.randn(2, 5, 4)
    assert F.linear(x, held).shape == (2, 5, 6)
    assert tape.linears == [(x, 3)]
    # what a layer may read of it, the real weight's: a layer may branch on it or make tensors where the weight is
    weight.requires_grad_(True)
    assert (held.shape, held.dtype, held.device, held.requires_grad) == (weight.shape, weight.dtype, weight.device, True)
    with pytest.raises(TypeError, match="outside F.linear"):
        x @ held.t()  # a weight read outside F.linear: a capture would have baked the captured layer's in
    with pytest.raises(TypeError, match="outside F.linear"):
        F.linear(x, held, torch.zeros(6))  # with a bias, a linear is not the tape's mm
    assert len(tape.linears) == 1


def _pytree_real(args):
    from torch.utils._pytree import tree_map_only

    return tree_map_only(Placeholder, lambda held: held.weight, args)


def test_a_placeholders_arguments_get_their_real_weights_flat_or_nested_as_pytree_gives_them():
    # the plain scan of flat arguments and pytree's walk of nested ones must hand a function the same arguments
    tape, weight, other = _Recorder(), torch.randn(6, 4), torch.randn(3)
    held = placeholder(weight, tape, at=0)
    cases = [
        (held, 2, None, "x"),
        (other, held),
        ([held, other], (1, (held,))),  # nested: pytree's path
        (torch.Size([2, 3]), held),  # a tuple subclass among the arguments
        {"weight": held, "alpha": 0.5},
        {"tensors": [held, other], "dim": 0},
        (),
        {},
    ]
    for args in cases:
        mine, theirs = _real(args), _pytree_real(args)
        assert type(mine) is type(theirs) and repr(mine) == repr(theirs)
        assert not any(isinstance(x, Placeholder) for x in (mine.values() if isinstance(mine, dict) else mine))
    assert _capturing((held, other), {}) and _capturing(([held],), {"w": held})

    def elsewhere():
        found.append(_capturing((held,), {}) or _capturing(([other, held],), {}))
        # not the capture's: computed on the real weight, through nested (a list) and keyword arguments alike
        found.append(torch.equal(torch.cat([held, held]), torch.cat([weight, weight])))
        found.append(torch.equal(torch.stack(tensors=[held]), weight[None]))

    found = []
    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert found == [False, True, True]
    with pytest.raises(TypeError, match="outside F.linear"):
        torch.cat([held, held])  # the capturing thread's: refused, nested as its argument is


def test_the_fold_check_follows_matmul():
    x = torch.randn(3, 7, 8)
    assert folds(x) and folds(x[:, :, :5]) and folds(x[0])
    assert not folds(x.transpose(0, 1))  # the leading dimensions do not fold into rows without a copy


@pytest.mark.parametrize("shape,take", [((2, 9, 16), None), ((9, 16), None), ((1, 9, 40), slice(8, 24))])
def test_a_tapes_linear_is_the_eager_linear_bit_for_bit(shape, take):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(12, 16)
    if take is not None:
        x = x[..., take]  # a slice of a wider projection, as a layer splits its fused q/k/v
    out = torch.empty(*x.shape[:-1], 12)
    linear = _Linear(x, 1, None, out)
    linear.run([None, weight])
    assert torch.equal(out, F.linear(x, weight))
    x.mul_(-0.5)  # the next replay's input, written in place where the graph before the linear writes it
    linear.run([None, 2 * weight])  # and the next layer's weight
    assert torch.equal(out, F.linear(x, 2 * weight))


def test_a_tapes_linear_casts_as_autocast_did():
    torch.manual_seed(0)
    x, weight = torch.randn(1, 9, 16), torch.randn(12, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, weight)
    out = torch.empty(1, 9, 12, dtype=torch.bfloat16)
    _Linear(x, 0, torch.bfloat16, out).run([weight])
    assert torch.equal(out, expected)


class _NothingCaptured:
    """A graph off CUDA: records nothing (the test below checks what the tape takes out, not what a replay gives)."""

    def capture_begin(self, pool=None, capture_error_mode=None):
        pass

    def capture_end(self):
        pass


class _TapeRecordingStandIn(_LayerStandIn):
    """The stand-in's capture and replay, after recording each capture on a real tape with placeholder weights."""

    def __init__(self):
        super().__init__()
        self.tapes = []

    def _capture(self, key, index, body, inputs, live=()):
        tape = Tape(None, None, graph_type=_NothingCaptured)
        tape.record(body, [x.clone() for x in inputs], live)
        self.tapes.append((tape, len(live)))
        return super()._capture(key, index, body, inputs, live)


def test_a_generated_layers_capture_takes_out_every_linear_and_reads_no_weight_otherwise(monkeypatch):
    monkeypatch.setattr(scoring_layers, "MIN_LIVE_BYTES", 0)  # at these widths every linear is small
    """The generated decoder layers (GDN and attention) record on the tape with their linears' weights as placeholders:
    every such weight reaches F.linear, none is read otherwise (that would raise), and each linear splits the capture."""
    stand_in = _TapeRecordingStandIn()
    monkeypatch.setattr(call_graphs_module, "LAYER_GRAPHS", stand_in)
    net, (ids, cu, _) = _model(), _batch()
    with torch.no_grad():
        expected = _eager(net, ids, cu)
        assert torch.equal(_log_probs(net, ids, cu), expected)
    assert len(stand_in.tapes) == 2  # one per kind
    for tape, live in stand_in.tapes:
        linears = [step for step in tape.steps if isinstance(step, _Linear)]
        assert live > 0 and sorted({step.at for step in linears}) == list(range(live))
        assert len(tape.steps) == 2 * len(linears) + 1  # graph, linear, graph, ..., graph
