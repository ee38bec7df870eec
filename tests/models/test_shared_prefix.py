"""Flag on vs flag off (shared_prefix.md section 6, E1-E7), dense and MoE, float64 on CPU."""

import pytest
import torch

from tests.models import tiny

# Two GRPO groups (one prefix aligned past a 64-chunk, one not), a singleton in between.
GROUPS = [(80, [10, 20, 15]), (70, [5, 1])]
SINGLES = [30]
CASES = [("qwen3_5", "gpu"), ("qwen3_5", "npu"), ("qwen3_5_moe", "gpu")]


def _batch():
    return tiny.grpo_batch(GROUPS, SINGLES, seed=7)


def _run(model, device, flag, *, grads=True, checkpointing=False, seed=0, **kwargs):
    extra = {"output_router_logits": False} if model == "qwen3_5_moe" and "output_router_logits" not in kwargs else {}
    net = tiny.build(model, device, seed=seed, shared_prefix_training=flag)
    if checkpointing:
        net.activation_checkpointing_enable() if hasattr(net, "activation_checkpointing_enable") else net.gradient_checkpointing_enable()
        net.train()
    out = net(**kwargs, **extra)
    if grads:
        (out.loss if out.loss is not None else out.logits.pow(2).mean()).backward()
    return out, (tiny.grads(net) if grads else None)


def _atol(model):
    # The MoE router's softmax runs in float32 (upstream), so routing weights carry float32 rounding.
    # A flip of one float32 rounding moves a gradient by ~1e-7; test_moe_exact_with_float64_router
    # shows the rest is float64-exact.
    return 1e-6 if model == "qwen3_5_moe" else 1e-10


def _both(model, device, **kwargs):
    return _run(model, device, False, **kwargs), _run(model, device, True, **kwargs)


@pytest.mark.parametrize("model,device", CASES)
def test_e1_e2_logits_loss_and_gradients_prompt_masked(model, device):
    ids, cu, prompt = _batch()
    labels = ids.masked_fill(prompt, -100)
    (off, g_off), (on, g_on) = _both(model, device, input_ids=ids, labels=labels, **tiny.packed_kwargs(cu))
    assert torch.allclose(on.logits, off.logits, atol=1e-10, rtol=0)
    assert torch.allclose(on.loss, off.loss, atol=1e-12, rtol=0)
    tiny.assert_grads_close(g_on, g_off, atol=_atol(model))


@pytest.mark.parametrize("model,device", CASES)
def test_e2_loss_and_gradients_prompt_labelled(model, device):
    ids, cu, _ = _batch()
    (off, g_off), (on, g_on) = _both(model, device, input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert torch.allclose(on.loss, off.loss, atol=1e-12, rtol=0)
    tiny.assert_grads_close(g_on, g_off, atol=_atol(model))
    # with num_items_in_batch (gradient accumulation) as well
    (off, _), (on, _) = _both(model, device, grads=False, input_ids=ids, labels=ids, num_items_in_batch=500, **tiny.packed_kwargs(cu))
    assert torch.allclose(on.loss, off.loss, atol=1e-12, rtol=0)


@pytest.mark.parametrize("model,device", CASES[:1] + CASES[2:])
def test_e3_position_ids_none(model, device):
    ids, cu, _ = _batch()
    (off, g_off), (on, g_on) = _both(model, device, input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert torch.allclose(on.logits, off.logits, atol=1e-10, rtol=0)
    tiny.assert_grads_close(g_on, g_off, atol=_atol(model))


@pytest.mark.parametrize("model,device", CASES[:1] + CASES[2:])
def test_e4_hidden_states_are_expanded(model, device):
    ids, cu, _ = _batch()
    (off, _), (on, _) = _both(model, device, grads=False, input_ids=ids, output_hidden_states=True, **tiny.packed_kwargs(cu))
    assert len(on.hidden_states) == len(off.hidden_states)
    for a, b in zip(on.hidden_states, off.hidden_states):
        assert a.shape == (1, ids.shape[1], 32)
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("keep", [7, "tensor"])
def test_e5_logits_to_keep(keep):
    ids, cu, _ = _batch()
    keep = torch.tensor([0, 5, 79, 80, 150]) if keep == "tensor" else keep
    (off, g_off), (on, g_on) = _both("qwen3_5", "gpu", input_ids=ids, logits_to_keep=keep, **tiny.packed_kwargs(cu))
    assert on.logits.shape == off.logits.shape
    assert torch.allclose(on.logits, off.logits, atol=1e-10, rtol=0)
    tiny.assert_grads_close(g_on, g_off)


@pytest.mark.parametrize("model,device", CASES[:1] + CASES[2:])
def test_e6_gradient_checkpointing(model, device):
    ids, cu, _ = _batch()
    kwargs = dict(input_ids=ids, labels=ids, checkpointing=True, **tiny.packed_kwargs(cu))
    (off, g_off), (on, g_on) = _both(model, device, **kwargs)
    assert torch.allclose(on.loss, off.loss, atol=1e-12, rtol=0)
    tiny.assert_grads_close(g_on, g_off, atol=_atol(model))


@pytest.mark.parametrize("model,device", CASES[:1] + CASES[2:])
def test_e7_log_probs_and_entropy(model, device):
    ids, cu, prompt = _batch()
    kwargs = dict(return_log_probs=True, return_entropy=True, return_logits=False, **tiny.packed_kwargs(cu))
    (off, _), (on, _) = _both(model, device, grads=False, input_ids=ids, **kwargs)
    assert on.logits is None and on.log_probs.shape == on.entropy.shape == ids.shape
    assert torch.allclose(on.log_probs, off.log_probs, atol=1e-12, rtol=0)
    assert torch.allclose(on.entropy, off.entropy, atol=1e-12, rtol=0)
    # the label of each sequence's last token is ignored (log-prob 0), not the next sequence's first
    assert (off.log_probs[0, cu[1:].long() - 1] == 0).all()
    # gradients of a policy-gradient-like objective on the log-probs
    adv = torch.randn(ids.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    g = {}
    for flag in (False, True):
        net = tiny.build(model, device, shared_prefix_training=flag)
        out = net(input_ids=ids, labels=ids.masked_fill(prompt, -100), **kwargs,
                  **({"output_router_logits": False} if model == "qwen3_5_moe" else {}))
        (out.log_probs * adv).sum().backward()
        g[flag] = tiny.grads(net)
    tiny.assert_grads_close(g[True], g[False], atol=max(_atol(model), 1e-9))


def test_moe_aux_loss_counts_packed_tokens(float64_router):
    ids, cu, _ = _batch()
    kwargs = dict(input_ids=ids, labels=ids, output_router_logits=True, **tiny.packed_kwargs(cu))
    (off, g_off), (on, g_on) = _both("qwen3_5_moe", "npu", **kwargs)
    # load_balancing_loss_func accumulates in float32, upstream's choice; same inputs, same value
    assert torch.allclose(on.aux_loss, off.aux_loss, rtol=1e-6, atol=0)
    assert torch.allclose(on.loss, off.loss, atol=1e-12, rtol=0)
    assert len(on.router_logits) == 4 and on.router_logits[0].shape == off.router_logits[0].shape
    tiny.assert_grads_close(g_on, g_off)


def test_compact_row_is_shorter_and_calls_are_fixed():
    from patchgen.kernels.modeling import shared_prefix

    ids, cu, _ = _batch()
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    from patchgen.kernels import ops

    plan = shared_prefix.plan_for(net.config, ops.of(net), input_ids=ids, position_ids=None, cache=None, use_cache=None,
                                  kwargs=tiny.packed_kwargs(cu))
    saved = sum((len(r) - 1) * p for p, r in GROUPS)
    assert plan.compact_length == ids.shape[1] - saved


def test_moe_exact_with_float64_router(float64_router):
    ids, cu, _ = _batch()
    (off, g_off), (on, g_on) = _both("qwen3_5_moe", "gpu", input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
    assert torch.allclose(on.loss, off.loss, atol=1e-12, rtol=0)
    tiny.assert_grads_close(g_on, g_off)


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_conditional_generation_text_only(model):
    """ForConditionalGeneration builds the patched text model and plans like ForCausalLM."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    mod = tiny.module(model, "gpu")
    config_cls = Qwen3_5Config if model == "qwen3_5" else Qwen3_5MoeConfig
    text = tiny.text_config(model, output_router_logits=False).to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    ids, cu, prompt = tiny.grpo_batch([(80, [10, 20])], [30], seed=7)
    res = {}
    for flag in (False, True):
        torch.manual_seed(0)
        net = getattr(mod, tiny.PREFIX[model] + "ForConditionalGeneration")(
            config_cls(text_config=dict(text, shared_prefix_training=flag), vision_config=vision)
        ).double()
        tiny.randomize(net)
        assert type(net.model.language_model).__module__ == mod.__name__
        out = net(input_ids=ids, labels=ids.masked_fill(prompt, -100), **tiny.packed_kwargs(cu))
        out.loss.backward()
        res[flag] = (out, tiny.grads(net))
    assert torch.allclose(res[True][0].logits, res[False][0].logits, atol=1e-10, rtol=0)
    assert torch.allclose(res[True][0].loss, res[False][0].loss, atol=1e-12, rtol=0)
    tiny.assert_grads_close(res[True][1], res[False][1], atol=_atol(model))


def _masked_rollout_batch():
    """Prompt 70, two rollouts whose responses share 5 leading tokens (the shared prefix runs into
    the responses); rollout 0 is masked out whole (filtered), rollout 1 is trained."""
    ids, cu, prompt = tiny.grpo_batch([(70, [12, 12])], [], seed=4)
    ids[0, 82 + 70 : 82 + 75] = ids[0, 70:75]
    labels = ids.masked_fill(prompt, -100)
    labels[0, :82] = -100
    return ids, cu, labels


@pytest.mark.parametrize("batch", ["masked_rollout", "multi_turn"])
def test_members_masking_shared_rows_differently_keep_packed_loss_and_log_probs(batch):
    if batch == "masked_rollout":
        ids, cu, labels = _masked_rollout_batch()
    else:  # B extends A; A trains its last turn, B masks A's turns (multi-turn SFT)
        gen = torch.Generator().manual_seed(5)
        a = torch.randint(0, tiny.VOCAB, (80,), generator=gen)
        ids = torch.cat([a, a, torch.randint(0, tiny.VOCAB, (20,), generator=gen)]).unsqueeze(0)
        cu = torch.tensor([0, 80, 180], dtype=torch.int32)
        labels = ids.clone()
        labels[0, :70] = -100
        labels[0, 80:160] = -100
    kwargs = dict(input_ids=ids, labels=labels, return_log_probs=True, **tiny.packed_kwargs(cu))
    (off, g_off), (on, g_on) = _both("qwen3_5", "gpu", **kwargs)
    assert torch.allclose(on.loss, off.loss, atol=1e-12, rtol=0)
    assert torch.allclose(on.log_probs, off.log_probs, atol=1e-12, rtol=0)
    tiny.assert_grads_close(g_on, g_off)


def test_a_config_with_use_cache_does_not_leak_state_across_packed_sequences():
    ids, cu, _ = _batch()
    for flag in (False, True):
        cached = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag, use_cache=True)
        plain = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag, use_cache=False)
        a = cached(input_ids=ids, **tiny.packed_kwargs(cu)).logits
        b = plain(input_ids=ids, **tiny.packed_kwargs(cu)).logits
        assert torch.equal(a, b)


def test_a_padding_mask_on_a_packed_row_is_refused():
    ids, cu, _ = _batch()
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    for flag in (False, True):
        net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
        with pytest.raises(ValueError, match="attention_mask with padding on a packed row"):
            net(input_ids=ids, attention_mask=mask, **tiny.packed_kwargs(cu))
