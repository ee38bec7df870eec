"""One model trains and generates: the flag changes packed training rows only; a training step builds a
cache only when asked, every other forward follows ``config.use_cache`` as upstream's does."""

import pytest
import torch

from tests.models import tiny


def _spy_gdn(net, module):
    calls = []
    table = module.ops.of(net)
    real = table.gated_delta_rule

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    table.__dict__["gated_delta_rule"] = spy
    return calls


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_generate_with_the_flag_on_equals_scoring_the_generated_row(model):
    extra = {"output_router_logits": False} if model == "qwen3_5_moe" else {}
    net = tiny.build(model, "gpu", shared_prefix_training=True, use_cache=True, **extra).eval()
    prompt = torch.randint(0, tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    out = net.generate(prompt, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
                       pad_token_id=0)
    full = net(input_ids=out.sequences).logits  # one uncached forward over prompt + generated tokens
    stepped = torch.stack(out.logits, 1).to(full.dtype)
    # Upstream's decode step (torch_recurrent_gated_delta_rule) computes in float32 even in a float64 model.
    assert torch.allclose(stepped, full[:, 11:-1], atol=1e-5, rtol=0)
    assert torch.equal(out.sequences[:, 12:], full[:, 11:-1].argmax(-1))


def test_prefill_runs_the_op_slots_and_stores_the_final_states():
    from transformers import DynamicCache

    net = tiny.build("qwen3_5", "gpu", use_cache=True)
    calls = _spy_gdn(net, tiny.module("qwen3_5", "gpu"))
    attention_calls = []
    table = tiny.module("qwen3_5", "gpu").ops.of(net)
    real_attention = table.attention
    table.__dict__["attention"] = lambda *a, **k: attention_calls.append(k) or real_attention(*a, **k)
    ids = torch.randint(0, tiny.VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=net.config)
    prefill = net(input_ids=ids, cache=cache, use_cache=True).logits
    linear = [i for i, t in enumerate(net.config.layer_types) if t == "linear_attention"]
    assert len(calls) == len(linear) and all(c["output_final_state"] for c in calls)
    assert all(cache.get_recurrent_state(i) is not None for i in linear)
    assert len(attention_calls) == net.config.layer_types.count("full_attention")
    assert all(c["cu_seqlens_q"].tolist() == [0, 16, 32] for c in attention_calls)
    assert cache.get_seq_length() == 16
    assert torch.allclose(prefill, net(input_ids=ids).logits, atol=1e-12, rtol=0)


def test_a_training_forward_with_a_use_cache_config_builds_no_cache_and_runs_the_op_slots():
    net = tiny.build("qwen3_5", "gpu", use_cache=True).train()
    calls = _spy_gdn(net, tiny.module("qwen3_5", "gpu"))
    ids = torch.randint(0, tiny.VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    out = net(input_ids=ids, labels=ids)
    assert out.cache is None
    assert len(calls) == net.config.layer_types.count("linear_attention")
    assert not any(c.get("output_final_state") for c in calls)


@pytest.mark.parametrize("mode", ["eval", "train, no_grad"])
def test_a_decode_loop_written_for_upstream_continues_from_the_cache_the_config_asks_for(mode):
    """``out = model(ids); model(next_ids, past_key_values=out.past_key_values)``: with no cache
    returned, the loop would silently score each new token as a sequence of its own."""
    net = tiny.build("qwen3_5", "gpu", use_cache=True)
    net.train(mode != "eval")
    ids = torch.randint(0, tiny.VOCAB, (1, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = net(input_ids=ids)
        assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 10
        steps, sequence = [out.logits[:, -1]], ids
        for _ in range(3):
            sequence = torch.cat([sequence, steps[-1].argmax(-1, keepdim=True)], 1)
            out = net(input_ids=sequence[:, -1:], past_key_values=out.past_key_values)
            steps.append(out.logits[:, -1])
        full = net(input_ids=sequence, use_cache=False).logits
    # the decode step (upstream's torch recurrence) computes in float32 even in a float64 model
    assert torch.allclose(torch.stack(steps, 1), full[:, 9:], atol=1e-5, rtol=0)


def test_a_forward_without_a_use_cache_config_builds_no_cache():
    net = tiny.build("qwen3_5", "gpu", use_cache=False).eval()
    ids = torch.randint(0, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert net(input_ids=ids).past_key_values is None


def test_use_cache_true_without_a_cache_still_returns_one():
    net = tiny.build("qwen3_5", "gpu")
    ids = torch.randint(0, tiny.VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    out = net(input_ids=ids, use_cache=True)
    assert out.cache is not None and out.cache.get_seq_length() == 8


def test_left_padded_batch_generation_equals_each_prompt_alone():
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, use_cache=True).eval()
    gen = torch.Generator().manual_seed(5)
    long, short = torch.randint(2, tiny.VOCAB, (12,), generator=gen), torch.randint(2, tiny.VOCAB, (7,), generator=gen)
    ids = torch.stack([long, torch.cat([torch.zeros(5, dtype=torch.long), short])])
    mask = torch.stack([torch.ones(12, dtype=torch.long), torch.cat([torch.zeros(5), torch.ones(7)]).long()])
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    batch = net.generate(ids, attention_mask=mask, **kw)
    for row, prompt in enumerate([long, short]):
        alone = net.generate(prompt.unsqueeze(0), **kw)
        assert torch.equal(batch.sequences[row, 12:], alone.sequences[0, len(prompt):])
        stepped = torch.stack(batch.logits, 1)[row]
        assert torch.allclose(stepped, torch.stack(alone.logits, 1)[0], atol=1e-5, rtol=0)


def test_a_moe_model_with_router_logits_on_generates_a_padded_batch_with_its_cache():
    """Trained with ``output_router_logits=True`` (the load-balancing loss), then generating: each decode step's
    router logits cover the new tokens only, while the attention mask covers the whole sequence (upstream's
    class fails there on the shapes)."""
    net = tiny.build("qwen3_5_moe", "gpu", use_cache=True).eval()
    ids = torch.randint(1, tiny.VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    with_router = net.generate(ids, **kw)
    net.config.output_router_logits = False
    without = net.generate(ids, **kw)
    assert torch.equal(with_router.sequences, without.sequences)
    assert all(torch.equal(a, b) for a, b in zip(with_router.logits, without.logits))
