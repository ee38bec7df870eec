"""Fused ops read a projection's `.weight` and skip its forward: a wrapped projection (a LoRA adapter,
written to PEFT's semantics: `tests/models/lora_like.py`) must be called instead, or the adapter would
be skipped silently (no delta in the loss, no gradient into the adapter). Against upstream's modeling
with the same wrappers, float64: loss and every gradient, the adapters' included, to 1e-10."""

import pytest
import torch
from patchgen.kernels.errors import WrappedModuleUnsupported

from tests.models import lora_like, tiny

MLP = ("gate_proj", "up_proj", "down_proj")


def _pair(monkeypatch, wrap_mlp=True, wrap_head=False, shared=False):
    """Ours (the generated gpu module, flag on or off) and upstream, the same weights and wrappers."""
    ours = tiny.build("qwen3_5", "gpu", shared_prefix_training=shared)
    theirs = tiny.upstream_model("qwen3_5", monkeypatch, ours.state_dict())
    for net in (ours, theirs):
        if wrap_mlp:
            for i, layer in enumerate(net.model.layers):
                for j, name in enumerate(MLP):
                    lora_like.wrap(layer.mlp, name, seed=10 * i + j)
        if wrap_head:
            lora_like.wrap(net, "lm_head", seed=99)
    return ours, theirs


def _logits_and_grads(net, packed: bool):
    """Logits, and the gradients of a float64 loss of them (upstream's own loss is computed in float32):
    the packed row in one call (ours), or each sequence alone (upstream, whose GDN does not split packed rows)."""
    ids, cu, _ = tiny.grpo_batch([(40, [7, 9, 5])], seed=3)
    net.zero_grad(set_to_none=True)
    if packed:
        logits = net(input_ids=ids, **tiny.packed_kwargs(cu)).logits
    else:
        logits = torch.cat([net(input_ids=ids[:, a:b]).logits for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    loss = sum(
        torch.nn.functional.cross_entropy(logits[0, a : b - 1].double(), ids[0, a + 1 : b], reduction="sum")
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
    )
    loss.backward()
    return logits.detach(), tiny.grads(net)


def _same(got, want):
    assert torch.allclose(got[0], want[0], atol=1e-12, rtol=0)
    tiny.assert_grads_close(got[1], want[1])


@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared_prefix"])
def test_lora_wrapped_mlp_projections_are_called_not_read(monkeypatch, shared):
    ours, theirs = _pair(monkeypatch, shared=shared)
    got = _logits_and_grads(ours, packed=True)
    _same(got, _logits_and_grads(theirs, packed=False))
    assert got[1]["model.layers.0.mlp.down_proj.lora_B.weight"].abs().max() > 0


def test_a_lora_wrapped_lm_head_is_called_not_read(monkeypatch):
    ours, theirs = _pair(monkeypatch, wrap_mlp=False, wrap_head=True, shared=True)
    got = _logits_and_grads(ours, packed=True)
    _same(got, _logits_and_grads(theirs, packed=False))
    assert got[1]["lm_head.lora_B.weight"].abs().max() > 0


def test_a_lora_wrapped_lm_head_scores_labels_through_the_adapter():
    """The loss path (the fused cross-entropy slot), flag on: equal to the loss of the adapter's logits."""
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    lora_like.wrap(net, "lm_head", seed=99)
    ids, cu, prompt = tiny.grpo_batch([(40, [7, 9, 5])], seed=3)
    labels = ids.masked_fill(prompt, -100)
    out = net(input_ids=ids, labels=labels, **tiny.packed_kwargs(cu), return_log_probs=True)
    logits = out.logits[0].double()
    targets = torch.nn.functional.pad(labels[0, 1:], (0, 1), value=-100)
    boundaries = cu[1:-1] - 1  # a sequence's last token predicts nothing
    targets[boundaries.long()] = -100
    want = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
    assert abs(out.loss.item() - want.item()) < 1e-10


def test_switching_the_adapters_off_gives_the_base_model(monkeypatch):
    ours, _ = _pair(monkeypatch)
    base = tiny.build("qwen3_5", "gpu")
    for layer in ours.model.layers:
        for name in MLP:
            getattr(layer.mlp, name)._disable_adapters = True
    ids, cu, _ = tiny.grpo_batch([(40, [7, 9, 5])], seed=4)
    with torch.no_grad():
        got = ours(input_ids=ids, **tiny.packed_kwargs(cu)).logits
        want = base(input_ids=ids, **tiny.packed_kwargs(cu)).logits
    assert torch.equal(got, want)


def test_a_wrapped_gdn_conv_is_refused_with_the_fix():
    net = tiny.build("qwen3_5", "gpu")
    gdn = net.model.layers[0].linear_attn

    class QuantisedConv(torch.nn.Conv1d):
        pass

    conv = QuantisedConv(gdn.conv1d.in_channels, gdn.conv1d.out_channels, gdn.conv1d.kernel_size, groups=gdn.conv1d.groups,
                         padding=gdn.conv1d.padding, bias=gdn.conv1d.bias is not None, dtype=gdn.conv1d.weight.dtype)
    gdn.conv1d = conv
    ids, cu, _ = tiny.grpo_batch([(30, [5, 6])], seed=6)
    with pytest.raises(WrappedModuleUnsupported, match="conv1d.*target_modules"):
        net(input_ids=ids, **tiny.packed_kwargs(cu))


def test_hooks_observe_without_changing_the_computation():
    """A NaN hunt or a departure probe hooks every module: the model runs and computes what it computes
    unhooked (the fused ops still read the projections' weights; their hooks do not fire, as in upstream's
    kernel paths), and the modules it calls report."""
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    ids, cu, prompt = tiny.grpo_batch([(30, [5, 6])], seed=6)
    labels = ids.masked_fill(prompt, -100)
    plain = net(input_ids=ids, labels=labels, **tiny.packed_kwargs(cu))
    fired = set()
    for name, module in net.named_modules():
        module.register_forward_hook(lambda m, i, o, name=name: fired.add(name))
    hooked = net(input_ids=ids, labels=labels, **tiny.packed_kwargs(cu))
    assert torch.equal(plain.loss, hooked.loss) and torch.equal(plain.logits, hooked.logits)
    assert {"model.layers.0.mlp", "model.layers.0.linear_attn.in_proj_qkv", "lm_head"} <= fired
    assert "model.layers.0.mlp.down_proj" not in fired and "model.layers.0.linear_attn.conv1d" not in fired
