"""The LM head scores only the rows something is owed to: rows whose label is ignored (the prompt of
an RL or SFT row) skip the ``[rows, vocab]`` product unless their entropy was asked for."""

import pytest
import torch
from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head
from patchgen.kernels.reference import cross_entropy as ref_ce


class CountingTable:
    """The one slot the head calls, counting the rows each call scores."""

    def __init__(self):
        self.rows = []

    def cross_entropy(self, hidden, weight, labels, **kwargs):
        self.rows.append(hidden.shape[0])
        return ref_ce.eager(hidden, weight, labels, **kwargs)

    def serving(self, slot, capability):
        return self.cross_entropy


def inputs(ignored_prefix=5):
    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 13, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(13, 8, generator=gen, dtype=torch.float64))
    hidden = torch.randn(1, 9, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    shift_labels = torch.randint(0, 13, (1, 9), generator=gen)
    shift_labels[0, :ignored_prefix] = -100
    return head, hidden, shift_labels


def full_softmax(head, hidden):
    return head(hidden).log_softmax(-1)


def run(request, **kwargs):
    head, hidden, shift_labels = inputs()
    table = CountingTable()
    out = causal_lm_head(head, table, hidden, request=request, kwargs={"shift_labels": shift_labels, **kwargs})
    return table.rows, out, head, hidden, shift_labels


def test_log_probs_and_loss_score_the_labelled_rows_only():
    rows, out, head, hidden, labels = run(HeadRequest(log_probs=True, logits=False))
    assert rows == [4]
    logp = full_softmax(head, hidden)
    valid = labels != -100
    expected = torch.where(valid, logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    torch.testing.assert_close(out.log_probs, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.loss, -expected.sum() / valid.sum(), rtol=0, atol=1e-12)


def test_gradients_equal_scoring_every_row():
    _, out, head, hidden, labels = run(HeadRequest(logits=False))
    (got,) = torch.autograd.grad(out.loss, hidden)
    nll = torch.nn.functional.cross_entropy(head(hidden)[0], labels[0], ignore_index=-100)
    (want,) = torch.autograd.grad(nll, hidden)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_entropy_keeps_every_row_unless_only_labelled_positions_are_wanted():
    rows, out, head, hidden, _ = run(HeadRequest(entropy=True, logits=False))
    logp = full_softmax(head, hidden)
    entropy = -(logp.exp() * logp).sum(-1)
    assert rows == [9]
    torch.testing.assert_close(out.entropy, entropy, rtol=0, atol=1e-12)

    rows, out, _, _, labels = run(HeadRequest(entropy=True, logits=False, labelled_only=True))
    assert rows == [4]
    torch.testing.assert_close(out.entropy, torch.where(labels != -100, entropy, 0.0), rtol=0, atol=1e-12)


def test_the_request_comes_from_the_forward_keyword():
    kwargs = {"return_entropy": True, "labelled_positions_only": True}
    assert HeadRequest.pop(kwargs).labelled_only and kwargs == {}


@pytest.mark.parametrize("ignored", [0, 9])
def test_rows_all_labelled_or_all_ignored_are_scored_in_one_call(ignored):
    head, hidden, labels = inputs(ignored)
    table = CountingTable()
    causal_lm_head(head, table, hidden, request=HeadRequest(logits=False), kwargs={"shift_labels": labels})
    assert table.rows == [9]
