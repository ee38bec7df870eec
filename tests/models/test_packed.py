"""Flag off, packed rows: equal to running every sequence alone; nothing leaks across boundaries."""

import pytest
import torch

from tests.models import tiny

TARGETS = sorted(tiny.MODULES)


@pytest.mark.parametrize("model,device", TARGETS)
def test_packed_equals_each_sequence_alone(model, device):
    net = tiny.build(model, device)
    lengths = [37, 5, 70, 1]
    ids, cu = tiny.packed_batch(lengths, seed=2)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    weights = torch.randn(1, cu[-1], tiny.VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    packed = net(input_ids=ids, position_ids=positions, **tiny.packed_kwargs(cu)).logits
    (packed * weights).sum().backward()
    g_packed = tiny.grads(net)
    net.zero_grad()
    alone = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        logits = net(input_ids=ids[:, s:e]).logits
        (logits * weights[:, s:e]).sum().backward()
        alone.append(logits)
    assert torch.allclose(packed, torch.cat(alone, 1), atol=1e-10, rtol=0)
    tiny.assert_grads_close(g_packed, tiny.grads(net))


def test_position_ids_default_to_per_sequence_positions_when_packed():
    net = tiny.build("qwen3_5", "gpu")
    ids, cu = tiny.packed_batch([20, 30], seed=4)
    positions = torch.cat([torch.arange(20), torch.arange(30)]).unsqueeze(0)
    a = net(input_ids=ids, **tiny.packed_kwargs(cu)).logits
    b = net(input_ids=ids, position_ids=positions, **tiny.packed_kwargs(cu)).logits
    assert torch.equal(a, b)


def test_loss_log_probs_and_entropy_when_packed():
    net = tiny.build("qwen3_5", "npu")
    ids, cu = tiny.packed_batch([20, 30], seed=4)
    out = net(input_ids=ids, labels=ids, return_log_probs=True, return_entropy=True, **tiny.packed_kwargs(cu))
    logp = out.logits.log_softmax(-1)
    target = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=0)
    expected = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    # The last token of each sequence has no next token (not the next sequence's first): not scored.
    ends = [19, 49]
    expected[:, ends] = 0
    assert torch.allclose(out.log_probs, expected, atol=1e-12)
    assert torch.allclose(out.entropy, -(logp.exp() * logp).sum(-1), atol=1e-12)
    assert torch.allclose(out.loss, -expected.sum() / (50 - len(ends)), atol=1e-12)


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_packed_metadata_is_built_once_per_micro_batch_not_per_layer(model, monkeypatch):
    """The GDN and conv slots get host boundaries and chunk indices, so no layer syncs to derive them."""
    mod = tiny.module(model, "gpu")
    from patchgen.kernels.modeling import packing

    builds, gdn_calls, conv_calls = [], [], []
    real_row = packing.PackedRow

    def counting_row(*args):
        builds.append(args)
        return real_row(*args)

    monkeypatch.setattr(packing, "PackedRow", counting_row)
    net = tiny.build(model, "gpu")
    table = mod.ops.of(net)
    real_gdn = table.gated_delta_rule

    def spy(*args, **kwargs):
        gdn_calls.append(kwargs)
        return real_gdn(*args, **kwargs)

    real_conv = table.causal_conv1d

    def conv_spy(*args, **kwargs):
        conv_calls.append(kwargs)
        return real_conv(*args, **kwargs)

    monkeypatch.setitem(table.__dict__, "gated_delta_rule", spy)  # the table is immutable by design
    monkeypatch.setitem(table.__dict__, "causal_conv1d", conv_spy)
    ids, cu = tiny.packed_batch([40, 9, 70], seed=5)
    net(input_ids=ids, **tiny.packed_kwargs(cu))
    linear_layers = net.config.layer_types.count("linear_attention")
    assert len(builds) == 1
    assert len(gdn_calls) == len(conv_calls) == linear_layers
    for kwargs in gdn_calls + conv_calls:
        assert kwargs["cu_seqlens_cpu"].device.type == "cpu"
        assert kwargs["chunk_indices"].tolist() == [[0, 0], [1, 0], [2, 0], [2, 1]]  # 40, 9, 70 tokens


def test_next_token_labels_end_every_sequence_with_ignore_even_around_empty_ones():
    from patchgen.kernels.modeling.packing import next_token_labels

    ids = torch.arange(10).unsqueeze(0)
    cu = torch.tensor([0, 0, 3, 3, 7, 10], dtype=torch.int32)  # empty, 3, empty, 4, 3 tokens
    assert next_token_labels(ids, cu).tolist() == [[1, 2, -100, 4, 5, 6, -100, 8, 9, -100]]
