"""shared_prefix_verify on ForConditionalGeneration, the class published Qwen3.5 checkpoints are saved as."""

import logging

import pytest
import torch
from patchgen.kernels.modeling import verify

from tests.models import tiny

TARGETS = pytest.mark.parametrize(
    "model,device", [("qwen3_5", "gpu"), ("qwen3_5", "npu"), ("qwen3_5_moe", "gpu"), ("qwen3_5_moe", "npu")]
)


@pytest.fixture(autouse=True)
def _float64_router(float64_router):
    """Exactness is asserted below, so the MoE router stays in float64 (upstream rounds it to float32)."""


def _net(model, device, **flags):
    return tiny.build_conditional(model, device, shared_prefix_min_length=4, **flags)


def _batch():
    ids, cu, prompt = tiny.grpo_batch([(70, [5, 9, 3])], [20], seed=11)
    return dict(input_ids=ids, labels=ids.masked_fill(prompt, -100), **tiny.packed_kwargs(cu))


@TARGETS
def test_first_shared_step_is_verified_logged_and_returns_the_shared_result(model, device, caplog):
    net = _net(model, device, shared_prefix_training=True, shared_prefix_verify=True)
    with caplog.at_level(logging.INFO, logger="patchgen.kernels.modeling.verify"):
        out = net(**_batch())
    assert "matches the packed path" in caplog.text
    assert verify.state(net).checks == 1 and verify.state(net).largest_verified == _batch()["input_ids"].shape[1]
    unverified = _net(model, device, shared_prefix_training=True)(**_batch())
    assert torch.equal(out.loss, unverified.loss)
    out.loss.backward()  # the returned result trains


@TARGETS
def test_a_mismatch_warns_and_returns_the_packed_result(model, device, monkeypatch):
    net = _net(model, device, shared_prefix_training=True, shared_prefix_verify=True)
    mod = tiny.module(model, device)
    real = mod.shared_prefix_gated_delta_rule
    monkeypatch.setattr(mod, "shared_prefix_gated_delta_rule", lambda *a, **k: real(*a, **k) + 0.5)
    with pytest.warns(verify.SharedPrefixMismatch, match="does not match the packed path"):
        out = net(**_batch())
    packed = _net(model, device)(**_batch())
    assert torch.allclose(out.loss, packed.loss, atol=1e-12, rtol=0)
    again = net(**_batch())
    assert torch.allclose(again.loss, packed.loss, atol=1e-12, rtol=0)


def test_a_batch_with_media_is_not_verified():
    """With images or videos the ordinary path runs (nothing is shared), so there is nothing to verify."""
    net = _net("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_verify=True)
    batch = _batch()
    kwargs = {k: v for k, v in batch.items() if k.startswith(("cu_", "max_"))}
    assert verify.due(net, batch["input_ids"], None, None, None, kwargs)
    assert not verify.due(net, batch["input_ids"], None, None, None, kwargs, pixel_values=torch.zeros(4, 3))
    assert not verify.due(net, batch["input_ids"], None, None, None, kwargs, pixel_values_videos=torch.zeros(4, 3))


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_flags_set_on_the_composite_config_are_honoured(model, caplog):
    """`model.config.<field> = ...` on the VL class lands on its top-level config, not its text_config: read there too."""
    net = _net(model, "gpu")
    net.config.shared_prefix_training = True
    net.config.shared_prefix_verify = True
    with caplog.at_level(logging.INFO, logger="patchgen.kernels.modeling.verify"):
        out = net(**_batch())
    assert "matches the packed path" in caplog.text and verify.state(net).checks == 1
    packed = _net(model, "gpu")(**_batch())
    assert torch.allclose(out.loss, packed.loss, atol=1e-12, rtol=0)


def test_a_flag_set_differently_on_both_configs_is_an_error_naming_text_config():
    from patchgen.kernels.errors import SettingError

    net = _net("qwen3_5", "gpu", shared_prefix_training=False)
    net.config.shared_prefix_training = True
    with pytest.raises(SettingError, match=r"shared_prefix_training.*text_config"):
        net(**_batch())
