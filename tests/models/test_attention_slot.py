"""Every forward without a cache, a packed row or a padding mask runs attention through the ``attention``
slot (each batch row one sequence), as packed rows and generation's prefill do.

Before, a plain training forward ``model(input_ids, labels=...)`` on unpacked rows went through
transformers' ``config._attn_implementation`` (sdpa), silently skipping the backend the op table chose
(flash-attention, torch varlen, npu_fusion_attention) although every other slot ran.
"""

import pytest
import torch

from tests.models import tiny

FULL = 2  # full-attention layers of the tiny config


def _spy_attention(net, model="qwen3_5"):
    calls = []
    table = tiny.module(model, "gpu").ops.of(net)
    real = table.attention
    table.__dict__["attention"] = lambda *a, **k: calls.append(k) or real(*a, **k)
    return calls


def _rows(batch=2, length=16, seed=3):
    return torch.randint(0, tiny.VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _each_row_packed(net, ids):
    """The same rows as one packed row (the slot's varlen path), unpacked again: an independent result."""
    batch, length = ids.shape
    cu = torch.arange(0, batch * length + 1, length, dtype=torch.int32)
    return net(input_ids=ids.reshape(1, -1), **tiny.packed_kwargs(cu)).logits.reshape(batch, length, -1)


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("mask", [None, "ones"])
def test_a_plain_training_forward_runs_the_attention_slot_once_per_layer(model, mask):
    net = tiny.build(model, "gpu", use_cache=True).train()
    calls = _spy_attention(net, model)
    ids = _rows()
    attention_mask = None if mask is None else torch.ones_like(ids)
    out = net(input_ids=ids, labels=ids, attention_mask=attention_mask)
    assert len(calls) == FULL
    assert all(c["cu_seqlens_q"].tolist() == [0, 16, 32] and c["causal"] for c in calls)
    assert torch.allclose(out.logits, _each_row_packed(net, ids), atol=1e-12, rtol=0)


def test_a_single_row_scored_without_a_cache_runs_the_attention_slot():
    net = tiny.build("qwen3_5", "gpu").eval()
    calls = _spy_attention(net)
    with torch.no_grad():
        net(input_ids=_rows(batch=1), use_cache=False)
    assert len(calls) == FULL and calls[0]["cu_seqlens_q"].tolist() == [0, 16]


def test_gradients_through_the_slot_equal_each_sequence_packed():
    ids = _rows()
    nets = [tiny.build("qwen3_5", "gpu").train() for _ in range(2)]
    nets[0](input_ids=ids, labels=ids).loss.backward()
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    flat = ids.reshape(1, -1)
    nets[1](input_ids=flat, labels=flat, **tiny.packed_kwargs(cu)).loss.backward()
    tiny.assert_grads_close(tiny.grads(nets[0]), tiny.grads(nets[1]), atol=1e-12)


def test_a_padding_mask_keeps_transformers_attention():
    """Padding is the mask's to express: the slot's rows would read the pads."""
    net = tiny.build("qwen3_5", "gpu").train()
    calls = _spy_attention(net)
    ids = _rows()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    net(input_ids=ids, attention_mask=mask)
    assert calls == []


def test_attention_dropout_in_training_keeps_transformers_attention():
    """The slot has no dropout: a config that asks for it trains through transformers' attention."""
    net = tiny.build("qwen3_5", "gpu", attention_dropout=0.1).train()
    calls = _spy_attention(net)
    net(input_ids=_rows(), labels=_rows())
    assert calls == []
    net.eval()
    with torch.no_grad():
        net(input_ids=_rows(), use_cache=False)
    assert len(calls) == FULL  # no dropout outside training


def test_attention_dropout_in_training_keeps_transformers_attention_in_a_cached_prefill():
    """A cached forward in training mode without a mask (a decode loop written for upstream, a training forward with
    ``use_cache=True``): the prefill's attention drops as a forward without a cache does. Before, the prefill took
    the slot, which has no dropout, while the decode steps after it dropped."""
    net = tiny.build("qwen3_5", "gpu", attention_dropout=0.1, use_cache=True).train()
    calls = _spy_attention(net)
    with torch.no_grad():
        out = net(input_ids=_rows(), use_cache=True)
    assert calls == [] and out.cache.get_seq_length() == 16


@pytest.mark.parametrize("use_cache", [False, True], ids=["no_cache", "cached_prefill"])
def test_a_training_mode_forward_with_attention_dropout_equals_upstreams_under_one_seed(use_cache):
    from tests.models import checkpoints as ckpt

    net = tiny.build("qwen3_5", "gpu", attention_dropout=0.3).train()
    upstream = ckpt.upstream_class("qwen3_5", "ForCausalLM")(tiny.text_config("qwen3_5", attention_dropout=0.3))
    upstream.double().train().load_state_dict(net.state_dict())
    logits = {}
    for name, model in (("ours", net), ("upstream", upstream)):
        torch.manual_seed(0)  # the same dropout masks, drawn in the same order
        with torch.no_grad():
            logits[name] = model(input_ids=_rows(), use_cache=use_cache).logits
    # upstream rounds its norms, decay and delta rule to float32 inside a float64 model
    torch.testing.assert_close(logits["ours"], logits["upstream"], atol=1e-5, rtol=0)
