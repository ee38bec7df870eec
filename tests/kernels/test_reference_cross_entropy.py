"""chunked and eager cross-entropy against float64 log-softmax, with ignored labels and entropy."""

import pytest
import torch
from patchgen.kernels.reference import cross_entropy

F64 = torch.float64


def naive(hidden, weight, labels):
    log_probs = torch.log_softmax(hidden @ weight.T, -1)
    keep = labels != -100
    nll = torch.stack(
        [-log_probs[i, labels[i]] if keep[i] else log_probs.new_zeros(()) for i in range(len(labels))]
    )
    return nll, -(log_probs.exp() * log_probs).sum(-1)


def data():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, 6, dtype=F64, generator=gen, requires_grad=True)
    weight = torch.randn(13, 6, dtype=F64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (11,), generator=gen)
    labels[[2, 7]] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("backend", ["chunked", "eager"])
def test_nll_and_entropy_and_gradients_match(backend, monkeypatch):
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 13 * 4)  # 4 rows per chunk: 3 chunks
    hidden, weight, labels = data()
    nll, entropy = getattr(cross_entropy, backend)(hidden, weight, labels, return_entropy=True)
    nll_ref, entropy_ref = naive(hidden, weight, labels)
    torch.testing.assert_close(nll, nll_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, entropy_ref, rtol=1e-12, atol=1e-12)
    assert nll[2] == 0 and nll[7] == 0
    a, b = torch.randn(11, dtype=F64), torch.randn(11, dtype=F64)
    ours = torch.autograd.grad((nll * a + entropy * b).sum(), (hidden, weight))
    ref = torch.autograd.grad((nll_ref * a + entropy_ref * b).sum(), (hidden, weight))
    for x, y in zip(ours, ref):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)


def test_entropy_is_none_unless_asked():
    hidden, weight, labels = data()
    assert cross_entropy.chunked(hidden, weight, labels)[1] is None
    assert cross_entropy.eager(hidden, weight, labels)[1] is None


def test_bf16_inputs_give_fp32_losses():
    hidden, weight, labels = data()
    nll, _ = cross_entropy.chunked(hidden.detach().bfloat16(), weight.detach().bfloat16(), labels)
    assert nll.dtype == torch.float32


def saved_sizes(fn, monkeypatch):
    """Sizes of the tensors autograd keeps for backward while ``fn`` runs forward."""
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 13 * 4)
    hidden, weight, labels = data()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nll, _ = fn(hidden, weight, labels)
    nll.sum().backward()
    return saved


def test_chunked_never_keeps_full_logits_for_backward(monkeypatch):
    full_logits = 11 * 13
    assert max(saved_sizes(cross_entropy.eager, monkeypatch)) >= full_logits  # the hook does see logits
    assert max(saved_sizes(cross_entropy.chunked, monkeypatch)) < full_logits
