"""A capability asked for by one call (entropy from cross_entropy) is served even when the bound
backend lacks it: auto and device defaults hand those calls on, explicit choices raise.

On the GPU the cross_entropy default is liger's fused head, which has no entropy; TRL asks for the
entropy on its policy pass. The fake backend here has liger's contract (per-token losses, no
entropy) and runs on CPU."""

import pytest
import torch
from patchgen.kernels import capabilities as caps
from patchgen.kernels import registry, selection
from patchgen.kernels.errors import BackendUnavailable
from patchgen.kernels.handles import KernelHandle
from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head, head_backend
from patchgen.kernels.reference import cross_entropy as ref_ce
from patchgen.kernels.selection import resolve

ENTRY = f"{__name__}:losses_only"


def losses_only(hidden, weight, labels, *, ignore_index=-100, return_entropy=False):
    if return_entropy:
        raise NotImplementedError("this backend has no entropy output")
    return ref_ce.eager(hidden, weight, labels, ignore_index=ignore_index)


@pytest.fixture(autouse=True)
def losses_only_backend(monkeypatch):
    for slot in registry.SLOTS:
        monkeypatch.delenv(f"PATCHGEN_OPS_{slot.upper()}", raising=False)
    fake = KernelHandle("cross_entropy", "losses_only", ENTRY, dtypes=caps.HALF_AND_FLOAT32 | {"float64"})
    monkeypatch.setitem(registry.BACKENDS, "cross_entropy", (fake, *registry.BACKENDS["cross_entropy"]))
    cpu_order = {**selection.AUTO_ORDER["cpu"], "cross_entropy": ("losses_only", "chunked", "eager")}
    monkeypatch.setitem(selection.AUTO_ORDER, "cpu", cpu_order)


def head_inputs():
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 8, generator=gen, dtype=torch.float64))
    hidden = torch.randn(1, 6, 8, generator=gen, dtype=torch.float64)
    labels = torch.tensor([[3, 1, -100, 7, 2, 9]])
    return head, hidden, labels


@pytest.mark.parametrize("how", ["auto", "device default"])
def test_entropy_calls_go_to_a_backend_that_has_entropy(how):
    table = resolve(None, "cpu") if how == "auto" else resolve(None, "cpu", defaults={"cross_entropy": "losses_only"})
    assert table.backend("cross_entropy") == "losses_only"
    head, hidden, labels = head_inputs()
    out = causal_lm_head(head, table, hidden, labels=labels, request=HeadRequest(log_probs=True, entropy=True))
    logits = head(hidden)[0, :-1]
    expected = torch.special.entr(logits.softmax(-1)).sum(-1)
    torch.testing.assert_close(out.entropy[0, :-1], expected, rtol=1e-12, atol=1e-12)
    assert table.serving("cross_entropy", caps.ENTROPY) is ref_ce.chunked


def test_calls_without_entropy_stay_on_the_bound_backend(monkeypatch):
    called, real = [], losses_only
    monkeypatch.setitem(globals(), "losses_only", lambda *a, **k: called.append("losses_only") or real(*a, **k))
    table = resolve(None, "cpu")  # loads the entry point now, through the spy
    head, hidden, labels = head_inputs()
    out = causal_lm_head(head, table, hidden, labels=labels, request=HeadRequest(log_probs=True))
    assert called == ["losses_only"] and torch.isfinite(out.loss)


def test_describe_shows_where_entropy_calls_go():
    table = resolve(None, "cpu")
    table.serving("cross_entropy", caps.ENTROPY)
    line = next(row for row in table.describe().splitlines() if row.startswith("cross_entropy [entropy]"))
    assert "chunked" in line and "'losses_only' lacks 'entropy'" in line


def test_explicit_choice_without_the_capability_raises_naming_it_and_the_alternatives():
    table = resolve({"cross_entropy": "losses_only"}, "cpu")
    head, hidden, labels = head_inputs()
    with pytest.raises(BackendUnavailable, match=r"'losses_only' cannot be used: lacks 'entropy'.*chunked, eager"):
        causal_lm_head(head, table, hidden, labels=labels, request=HeadRequest(entropy=True))


def test_backend_with_the_capability_is_its_own_server():
    table = resolve({"cross_entropy": "eager"}, "cpu")
    assert table.serving("cross_entropy", caps.ENTROPY) is table.cross_entropy



def _spy_on_losses_only(monkeypatch) -> list:
    called, real = [], losses_only
    monkeypatch.setitem(globals(), "losses_only", lambda *a, **k: called.append("losses_only") or real(*a, **k))
    return called


@pytest.mark.parametrize("entropy", [False, True])
def test_scoring_calls_go_to_a_backend_that_reads_nothing_back(monkeypatch, entropy):
    """liger's head (here its stand-in, which lacks `sync_free`) counts its targets on the host; a pass without
    gradients goes to the first backend of the order that does not, so a scoring loop never waits on the device."""
    called = _spy_on_losses_only(monkeypatch)
    table = resolve(None, "cpu")  # loads the entry point now, through the spy
    head, hidden, labels = head_inputs()
    request = HeadRequest(log_probs=True, entropy=entropy)
    with torch.no_grad():
        scored = causal_lm_head(head, table, hidden, labels=labels, request=request)
        assert head_backend(table, request) is table.serving("cross_entropy", caps.SYNC_FREE)
    assert called == [] and table.serving_choice("cross_entropy", caps.SYNC_FREE).backend == "chunked"
    trained = causal_lm_head(head, table, hidden.requires_grad_(), labels=labels, request=HeadRequest(log_probs=True))
    assert called == ["losses_only"]  # control: with gradients the bound backend runs
    torch.testing.assert_close(scored.log_probs, trained.log_probs.detach(), rtol=0, atol=1e-12)


def test_an_explicit_backend_scores_without_gradients_too(monkeypatch):
    called = _spy_on_losses_only(monkeypatch)
    table = resolve({"cross_entropy": "losses_only"}, "cpu")
    head, hidden, labels = head_inputs()
    with torch.no_grad():
        causal_lm_head(head, table, hidden, labels=labels, request=HeadRequest(log_probs=True))
    assert called == ["losses_only"]
