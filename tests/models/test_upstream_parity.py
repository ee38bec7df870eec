"""Flag off: every generated module equals upstream transformers (float64, tiny random configs)."""

import pytest
import torch

from tests.models import tiny

TARGETS = sorted(tiny.MODULES)


def _loss_from_logits(logits, ids):
    # A float64 loss of the logits (upstream's own loss casts to float32).
    return torch.nn.functional.cross_entropy(logits[0, :-1].double(), ids[0, 1:]) + 1e-3 * logits.pow(2).mean()


@pytest.mark.parametrize("model,device", TARGETS)
def test_logits_loss_and_every_gradient_equal_upstream(model, device, monkeypatch):
    ours = tiny.build(model, device)
    up = tiny.upstream_model(model, monkeypatch, ours.state_dict())
    ids, _ = tiny.packed_batch([70], seed=1)
    out_ours, out_up = ours(input_ids=ids, labels=ids), up(input_ids=ids, labels=ids)
    assert torch.allclose(out_ours.logits, out_up.logits, atol=1e-12, rtol=0)
    # upstream computes the loss in float32: equal to float32 rounding
    assert torch.allclose(out_ours.loss, out_up.loss.double(), rtol=1e-6, atol=0)
    _loss_from_logits(out_ours.logits, ids).backward()
    _loss_from_logits(out_up.logits, ids).backward()
    g_ours, g_up = tiny.grads(ours), tiny.grads(up)
    assert g_ours.keys() == g_up.keys() and len(g_ours) == len(list(ours.parameters()))
    for name in g_ours:
        assert torch.allclose(g_ours[name], g_up[name], atol=1e-10, rtol=0), name


@pytest.mark.parametrize("model,device", TARGETS)
def test_state_dict_loads_both_ways_with_identical_names(model, device, monkeypatch):
    ours = tiny.build(model, device)
    up = tiny.upstream_model(model, monkeypatch, ours.state_dict())
    assert list(ours.state_dict()) == list(up.state_dict())
    fresh = tiny.build(model, device, seed=5)
    fresh.load_state_dict(up.state_dict())
    for (name, a), b in zip(fresh.state_dict().items(), up.state_dict().values()):
        assert torch.equal(a, b), name


def test_ops_are_bound_once_at_build():
    net = tiny.build("qwen3_5", "gpu")
    tables = {id(getattr(m, "_patchgen_ops", None)) for m in net.modules()}
    assert len(tables) == 1 and net.model.layers[0].linear_attn._patchgen_ops.backend("gated_delta_rule") == "torch"
    assert "_patchgen_ops" not in str(list(net.state_dict()))
