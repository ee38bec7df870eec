"""Labels as upstream reads them: shapes checked by name, ``logits_to_keep`` with labels, temperature."""

import pytest
import torch
import torch.nn.functional as F

from tests.models import tiny


def _net(flag=False):
    return tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)


def _ids(length=20, seed=0):
    return torch.randint(0, tiny.VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _upstream_loss(logits, labels):
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


def test_labels_one_shorter_than_input_ids_is_an_error_as_upstream():
    ids = _ids()
    with pytest.raises(ValueError, match=r"labels has shape \(1, 19\) but the input is \(1, 20\)"):
        _net()(input_ids=ids, labels=ids[:, 1:])


@pytest.mark.parametrize("labels", [
    torch.zeros(1, 1, 20, dtype=torch.long),
    torch.zeros(2, 20, dtype=torch.long),
    torch.zeros(1, 21, dtype=torch.long),
    torch.zeros(1, 20),
])
def test_labels_of_other_wrong_shapes_or_dtypes_name_the_problem(labels):
    with pytest.raises(ValueError, match="labels"):
        _net()(input_ids=_ids(), labels=labels)


def test_shift_labels_of_a_wrong_shape_name_the_problem():
    with pytest.raises(ValueError, match="shift_labels has shape"):
        _net()(input_ids=_ids(), shift_labels=torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("flag", [False, True])
def test_logits_to_keep_with_labels_of_the_whole_row_scores_the_kept_positions(flag):
    net = _net(flag)
    ids = _ids(30)
    full = net(input_ids=ids).logits
    out = net(input_ids=ids, labels=ids, logits_to_keep=8)
    assert out.logits.shape == (1, 8, tiny.VOCAB)
    expected = F.cross_entropy(full[0, -8:-1], ids[0, -7:])  # the last kept position has no next token
    assert torch.allclose(out.loss, expected, atol=1e-12, rtol=0)


def test_logits_to_keep_with_labels_of_the_kept_positions_is_upstream():
    net = _net()
    ids = _ids(30)
    out = net(input_ids=ids, labels=ids[:, -8:], logits_to_keep=8)
    assert torch.allclose(out.loss, _upstream_loss(out.logits, ids[:, -8:]), atol=1e-12, rtol=0)


def test_logits_to_keep_as_indices_with_labels():
    net = _net()
    ids = _ids(30)
    keep = torch.tensor([3, 10, 11])
    full = net(input_ids=ids).logits
    out = net(input_ids=ids, labels=ids, logits_to_keep=keep)
    expected = F.cross_entropy(full[0, keep], ids[0, keep + 1])
    assert torch.allclose(out.loss, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("flag", [False, True])
def test_temperature_scores_logits_divided_by_it(flag):
    net = _net(flag)
    ids, cu, _ = tiny.grpo_batch([(70, [6, 9])], seed=3)
    kw = tiny.packed_kwargs(cu)
    out = net(input_ids=ids, labels=ids, return_log_probs=True, return_entropy=True, temperature=0.7, **kw)
    logp = (out.logits / 0.7).log_softmax(-1)
    target = F.pad(ids[:, 1:], (0, 1), value=0)
    expected = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    valid = torch.ones_like(expected, dtype=torch.bool)
    valid[0, cu[1:] - 1] = False  # no next token at the end of a sequence
    valid[0, -1] = False
    assert torch.allclose(out.log_probs[valid], expected[valid], atol=1e-12)
    assert torch.allclose(out.entropy, -(logp.exp() * logp).sum(-1), atol=1e-12)


def test_a_non_positive_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        _net()(input_ids=_ids(), return_log_probs=True, temperature=0.0)


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("metadata", ["cu_seq_lens", "position_ids"])
def test_packed_labels_never_score_the_next_sequences_first_token(flag, metadata):
    # labels = input ids on a packed row: each sequence's last token has no next token, so the loss is
    # each sequence's own next-token loss, token-weighted, exactly as with collator-style labels (-100
    # at every sequence start) and as each sequence scored alone.
    lengths = [70, 75, 90]
    ids, cu = tiny.packed_batch(lengths, shared=66, seed=3)
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag).double()
    if metadata == "cu_seq_lens":
        packed = tiny.packed_kwargs(cu)
    else:
        packed = {"position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    loss = net(input_ids=ids, labels=ids, **packed).loss
    separated = ids.clone()
    separated[0, cu[:-1].long()] = -100
    assert torch.allclose(loss, net(input_ids=ids, labels=separated, **packed).loss, rtol=0, atol=1e-12)
    total = sum(
        net(input_ids=seq[None], labels=seq[None]).loss * (len(seq) - 1) for seq in torch.split(ids[0], lengths)
    )
    assert torch.allclose(loss, total / (sum(lengths) - len(lengths)), rtol=0, atol=1e-10)
