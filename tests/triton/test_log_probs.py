"""The scoring head's row statistics (`kernels/triton/log_probs.py`) against a full log-softmax: nll of the
target (0 where ignored) and entropy, over several vocabulary blocks, for fp64 and bf16 logits; the slot
function scores a chunk of rows at a time as the reference does, and hands a call that wants gradients to the reference."""

import pytest
import torch
from patchgen.kernels.reference.cross_entropy import chunked
from patchgen.kernels.triton import log_probs
from patchgen.kernels.triton.log_probs import cross_entropy, row_log_probs, row_log_probs_reference
from triton_helpers import max_err


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(log_probs, "MAX_BLOCK", 16)  # V = 37: three blocks, the last one partial


def _targets(rows, vocab, device, ignored=(1, 4)):
    targets = torch.randint(0, vocab, (rows,), device=device)
    targets[list(ignored)] = -100
    return targets


@pytest.mark.parametrize("entropy", [False, True])
def test_nll_and_entropy_over_several_blocks_equal_a_full_log_softmax(device, small_blocks, entropy):
    logits = torch.randn(6, 37, dtype=torch.float64, device=device) * 4
    targets = _targets(6, 37, device)
    nll, ent = row_log_probs(logits, targets, return_entropy=entropy)
    ref_nll, ref_ent = row_log_probs_reference(logits, targets, return_entropy=entropy)
    assert nll.dtype == torch.float64 and max_err(nll, ref_nll) < 1e-12
    assert (nll[[1, 4]] == 0).all()
    if entropy:
        assert max_err(ent, ref_ent) < 1e-12 and (ent[[1, 4]] > 0).all()  # an ignored target still has entropy
    else:
        assert ent is None


def test_large_logits_do_not_overflow(device, small_blocks):
    logits = torch.randn(3, 37, dtype=torch.float64, device=device) + torch.tensor([[1e4], [-1e4], [0.0]], device=device)
    targets = torch.tensor([0, 5, 36], device=device)
    nll, ent = row_log_probs(logits, targets, return_entropy=True)
    ref_nll, ref_ent = row_log_probs_reference(logits, targets, return_entropy=True)
    assert torch.isfinite(nll).all() and max_err(nll, ref_nll) < 1e-9 and max_err(ent, ref_ent) < 1e-9


def test_bf16_logits_are_read_in_fp32(device, small_blocks):
    logits = (torch.randn(8, 37, device=device) * 5).bfloat16()
    targets = _targets(8, 37, device, ignored=())
    nll, ent = row_log_probs(logits, targets, return_entropy=True)
    ref_nll, ref_ent = row_log_probs_reference(logits, targets, return_entropy=True)
    assert nll.dtype == torch.float32
    # the same bf16 values summed in fp32 in another order: fp32 rounding apart
    assert max_err(nll, ref_nll) < 1e-5 and max_err(ent, ref_ent) < 1e-5


def test_the_slot_scores_chunk_by_chunk_as_the_reference_does(device, small_blocks, monkeypatch):
    hidden = torch.randn(11, 8, dtype=torch.float64, device=device)
    weight = torch.randn(37, 8, dtype=torch.float64, device=device)
    targets = _targets(11, 37, device)
    whole = cross_entropy(hidden, weight, targets, return_entropy=True)
    monkeypatch.setattr(log_probs, "CHUNK_ELEMENTS", 4 * 37)  # four rows a chunk: three chunks
    pieces = cross_entropy(hidden, weight, targets, return_entropy=True)
    ref = chunked(hidden, weight, targets, return_entropy=True)
    for a, b, r in zip(whole, pieces, ref):
        assert max_err(a, r) < 1e-12 and max_err(b, r) < 1e-12


def test_a_call_that_wants_gradients_goes_to_the_reference(device, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton pass has no backward")

    monkeypatch.setattr(log_probs, "row_log_probs", refuse)
    hidden = torch.randn(5, 8, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(37, 8, dtype=torch.float64, device=device)
    targets = _targets(5, 37, device)
    nll, _ = cross_entropy(hidden, weight, targets)
    nll.sum().backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    chunked(ref_hidden, weight, targets)[0].sum().backward()
    assert max_err(hidden.grad, ref_hidden.grad) < 1e-12
    with torch.no_grad(), pytest.raises(AssertionError, match="no backward"):
        cross_entropy(hidden, weight, targets)  # control: without gradients the Triton pass runs
