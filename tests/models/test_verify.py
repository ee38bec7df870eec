"""shared_prefix_verify: the first shared step (and each longer one) is checked against the packed path."""

import logging

import pytest
import torch
from patchgen.kernels.modeling import shared_prefix, verify

from tests.models import tiny


def _net(**extra):
    return tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_verify=True, **extra)


def _plans(monkeypatch):
    built = []
    real = shared_prefix.build_plan

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        built.append(plan)
        return plan

    monkeypatch.setattr(shared_prefix, "build_plan", spy)
    return built


def _batch(prompt=70):
    return tiny.grpo_batch([(prompt, [5, 9, 3])], [20], seed=11)


def test_first_shared_step_is_verified_logged_and_returns_the_shared_result(monkeypatch, caplog):
    net = _net()
    built = _plans(monkeypatch)
    ids, cu, _ = _batch()
    with caplog.at_level(logging.INFO, logger="patchgen.kernels.modeling.verify"):
        out = net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert "matches the packed path" in caplog.text
    assert len(built) == 1  # the shared run planned; the packed reference did not
    plain = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert torch.equal(out.loss, plain.loss)
    out.loss.backward()  # the returned result trains
    assert verify.state(net).largest_verified == ids.shape[1]


def test_only_a_longer_row_than_verified_is_verified_again(monkeypatch):
    net = _net()
    ids, cu, _ = _batch()
    net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert verify.state(net).checks == 1
    longer, cu_longer, _ = _batch(prompt=90)
    net(input_ids=longer, labels=longer, **tiny.packed_kwargs(cu_longer))
    assert verify.state(net).checks == 2


def test_a_mismatch_warns_returns_the_packed_result_and_stays_packed(monkeypatch):
    net = _net()
    mod = tiny.module("qwen3_5", "gpu")
    real = mod.shared_prefix_gated_delta_rule

    def wrong(*args, **kwargs):
        return real(*args, **kwargs) + 0.5  # a broken compact row

    monkeypatch.setattr(mod, "shared_prefix_gated_delta_rule", wrong)
    ids, cu, _ = _batch()
    with pytest.warns(verify.SharedPrefixMismatch, match="does not match the packed path"):
        out = net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    packed = tiny.build("qwen3_5", "gpu")(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert torch.allclose(out.loss, packed.loss, atol=1e-12, rtol=0)
    built = _plans(monkeypatch)
    again = net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert not built and torch.allclose(again.loss, packed.loss, atol=1e-12, rtol=0)


def test_verification_is_off_by_default(monkeypatch):
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    ids, cu, _ = _batch()
    net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert getattr(net, verify.ATTRIBUTE, None) is None


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-8), (torch.bfloat16, 0.125)])
def test_the_bound_follows_the_dtype_and_the_scale(dtype, bound):
    assert verify.bound(dtype, 0.5) == bound
    assert verify.bound(dtype, 10.0) == bound * 10


def test_a_row_marked_by_seq_idx_alone_is_verified(monkeypatch):
    """DataCollatorWithFlattening(return_seq_idx=True, return_position_ids=False): no cu_seq_lens, no positions."""
    net = _net()
    built = _plans(monkeypatch)
    ids, cu, _ = _batch()
    seq_idx = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff().long()).unsqueeze(0).int()
    out = net(input_ids=ids, labels=ids, seq_idx=seq_idx)
    assert verify.state(net).checks == 1 and len(built) == 1 and built[0] is not None
    assert torch.equal(out.loss, net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu)).loss)


def _bounds_asked(monkeypatch):
    dtypes = []
    real = verify.bound

    def spy(dtype, scale):
        dtypes.append(dtype)
        return real(dtype, scale)

    monkeypatch.setattr(verify, "bound", spy)
    return dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_model_is_held_to_its_own_dtypes_bound(monkeypatch, caplog, dtype):
    """The log-probs compared are float32 (the head upcasts), which once set the bound: a bf16 model was held to
    float32's 1e-3 instead of bf16's 0.125 and could warn of a mismatch that was only rounding."""
    net = _net().to(dtype)
    dtypes = _bounds_asked(monkeypatch)
    ids, cu, _ = _batch()
    with caplog.at_level(logging.INFO, logger="patchgen.kernels.modeling.verify"):
        out = net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert out.log_probs.dtype == torch.float32
    assert dtypes == [dtype]
    assert str(dtype) in caplog.text


def test_under_autocast_the_bound_is_autocasts_dtype(monkeypatch):
    net = _net().float()
    dtypes = _bounds_asked(monkeypatch)
    ids, cu, _ = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert dtypes == [torch.bfloat16]


def _generate_without_a_cache(net, lengths):
    prompts, mask = tiny.left_padded_batch(lengths, pad=0)
    net.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=2, do_sample=False, use_cache=False,
                 pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("prompts", ["one", "left-padded"])
def test_generation_without_a_cache_is_not_verified_and_a_later_packed_row_still_is(prompts):
    """generate(use_cache=False) passes ``position_ids`` with its ``[B, L]`` rows, which are not packed: nothing is
    shared. Before, each step ran twice and marked its length verified, so a shorter packed row went unchecked."""
    net = _net().eval()
    ids, cu, _ = _batch()
    _generate_without_a_cache(net, (ids.shape[1] + 5,) if prompts == "one" else (ids.shape[1] + 5, 9))
    assert verify.state(net).checks == 0
    net.train()
    net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert verify.state(net).checks == 1 and verify.state(net).largest_verified == ids.shape[1]


def test_a_padded_batch_scored_with_its_positions_is_not_verified():
    """verl-style positions ``clip(cumsum(mask) - 1, 0)`` put every left pad at 0; the batch runs unpacked."""
    net = _net().eval()
    prompts, mask = tiny.left_padded_batch((30, 9), pad=0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        net(input_ids=prompts, attention_mask=mask, position_ids=positions)
    assert verify.state(net).checks == 0 and verify.state(net).largest_verified == 0
