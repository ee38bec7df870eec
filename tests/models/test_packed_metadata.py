"""Packed-row metadata: boundaries from restarting position_ids, and every malformed form refused clearly."""

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from patchgen.kernels.modeling.boundaries import PackedMetadataError

from tests.models import tiny

LENGTHS = [23, 5, 40, 1]


def _row(seed=2):
    ids, cu = tiny.packed_batch(LENGTHS, seed=seed)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, cu, positions


def _alone(net, ids, cu):
    return torch.cat([net(input_ids=ids[:, s:e]).logits for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("flag", [False, True])
def test_restarting_position_ids_alone_pack_the_row(model, flag):
    """DataCollatorWithFlattening's default output: no cu_seq_lens, positions restart at 0 per sequence."""
    extra = {"output_router_logits": False} if model == "qwen3_5_moe" else {}
    net = tiny.build(model, "gpu", shared_prefix_training=flag, **extra)
    ids, cu, positions = _row()
    by_positions = net(input_ids=ids, position_ids=positions).logits
    assert torch.allclose(by_positions, _alone(net, ids, cu), atol=1e-10, rtol=0)
    assert torch.equal(by_positions, net(input_ids=ids, position_ids=positions, **tiny.packed_kwargs(cu)).logits)


def test_restarting_position_ids_reach_the_backbone_called_directly():
    """TRL's fused LM head calls ``model.model`` with the position_ids of a padding-free row."""
    net = tiny.build("qwen3_5", "npu")
    ids, cu, positions = _row(seed=3)
    hidden = net.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    assert torch.allclose(net.lm_head(hidden), _alone(net, ids, cu), atol=1e-10, rtol=0)


def test_cu_seq_lens_k_different_from_q_is_refused():
    net = tiny.build("qwen3_5", "gpu")
    ids, cu, _ = _row()
    other = torch.tensor([0, 23, 30, 68, 69], dtype=torch.int32)
    with pytest.raises(PackedMetadataError, match="cu_seq_lens_k .* differs from cu_seq_lens_q"):
        net(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=other)


def test_cu_seq_lens_k_alone_is_refused():
    net = tiny.build("qwen3_5", "gpu")
    ids, cu, _ = _row()
    with pytest.raises(PackedMetadataError, match="without cu_seq_lens_q"):
        net(input_ids=ids, cu_seq_lens_k=cu)


@pytest.mark.parametrize("flag", [False, True])
def test_position_ids_that_disagree_with_cu_seq_lens_are_refused(flag):
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
    ids, cu, _ = _row()
    whole_row = torch.arange(ids.shape[1]).unsqueeze(0)  # positions never restart
    with pytest.raises(PackedMetadataError, match="position_ids disagree .* token 23 has position 23, expected 0"):
        net(input_ids=ids, position_ids=whole_row, **tiny.packed_kwargs(cu))


def test_position_ids_restarting_but_not_counting_up_are_refused():
    net = tiny.build("qwen3_5", "gpu")
    ids, _, positions = _row()
    positions = positions.clone()
    positions[0, 30] = 7
    with pytest.raises(PackedMetadataError, match="token 30 has position 7"):
        net(input_ids=ids, position_ids=positions)


@pytest.mark.parametrize("cu,match", [
    (torch.tensor([[0, 23, 28, 68, 69]], dtype=torch.int32), "must be 1-D"),
    (torch.tensor([0.0, 23.0, 28.0, 68.0, 69.0]), "must hold integers"),
    (torch.tensor([0, 23, 28, 68], dtype=torch.int32), "end at 69"),
    (torch.tensor([1, 23, 28, 68, 69], dtype=torch.int32), "start at 0"),
    (torch.tensor([0, 28, 23, 68, 69], dtype=torch.int32), "never decrease"),
    (torch.tensor([0], dtype=torch.int32), "at least"),
])
def test_malformed_cu_seq_lens_are_refused_by_name(cu, match):
    net = tiny.build("qwen3_5", "gpu")
    ids, _, _ = _row()
    with pytest.raises(PackedMetadataError, match=match):
        net(input_ids=ids, cu_seq_lens_q=cu)


def test_cu_seq_lens_with_a_batch_of_rows_is_refused():
    net = tiny.build("qwen3_5", "gpu")
    ids = torch.randint(0, tiny.VOCAB, (2, 10))
    with pytest.raises(PackedMetadataError, match="batch 1"):
        net(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4, 10], dtype=torch.int32))


def _segments(draw_lengths):
    cu = [0]
    for n in draw_lengths:
        cu.append(cu[-1] + n)
    return cu


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    cu_edit=st.sampled_from(["none", "as_given", "drop_last", "shift", "swap", "k_differs", "two_d", "float", "empty"]),
    pos_edit=st.sampled_from(["none", "per_sequence", "whole_row", "off_by_one", "poke"]),
    poke=st.integers(0, 1000),
)
def test_random_packed_metadata_gives_a_clear_error_or_each_sequence_alone(lengths, cu_edit, pos_edit, poke):
    """Whatever metadata comes with a row: a ValueError, or exactly the logits of each sequence run alone."""
    net = _hypothesis_net()
    total = sum(lengths)
    ids = torch.randint(0, tiny.VOCAB, (1, total), generator=torch.Generator().manual_seed(poke))
    true_cu = _segments(lengths)
    kwargs = {}
    cu = torch.tensor(true_cu, dtype=torch.int32)
    if cu_edit == "as_given":
        kwargs["cu_seq_lens_q"] = cu
    elif cu_edit == "drop_last":
        kwargs["cu_seq_lens_q"] = cu[:-1]
    elif cu_edit == "shift":
        kwargs["cu_seq_lens_q"] = cu + 1
    elif cu_edit == "swap" and len(true_cu) > 2:
        kwargs["cu_seq_lens_q"] = cu[[0, 2, 1, *range(3, len(true_cu))]] if len(true_cu) > 3 else cu.flip(0)
    elif cu_edit == "k_differs":
        kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"] = cu, torch.tensor([0, total], dtype=torch.int32)
    elif cu_edit == "two_d":
        kwargs["cu_seq_lens_q"] = cu.unsqueeze(0)
    elif cu_edit == "float":
        kwargs["cu_seq_lens_q"] = cu.float()
    elif cu_edit == "empty":
        kwargs["cu_seq_lens_q"] = cu[:0]
    positions = torch.cat([torch.arange(n) for n in lengths])
    if pos_edit == "per_sequence":
        kwargs["position_ids"] = positions.unsqueeze(0)
    elif pos_edit == "whole_row":
        kwargs["position_ids"] = torch.arange(total).unsqueeze(0)
    elif pos_edit == "off_by_one":
        kwargs["position_ids"] = (positions + 1).unsqueeze(0)
    elif pos_edit == "poke":
        positions = positions.clone()
        positions[poke % total] = poke % 5
        kwargs["position_ids"] = positions.unsqueeze(0)

    try:
        logits = net(input_ids=ids, **kwargs).logits
    except ValueError as error:
        assert str(error), "an empty error message"
        return
    # Accepted: the result must be that of the sequences the metadata describes, each run alone.
    given_cu = kwargs.get("cu_seq_lens_q")
    if given_cu is not None:
        bounds = given_cu.tolist()
    elif "position_ids" in kwargs and kwargs["position_ids"][0, 0] == 0:
        starts = (kwargs["position_ids"][0] == 0).nonzero().flatten().tolist()
        bounds = [*starts, total]
    else:
        bounds = [0, total]
    alone = []
    for s, e in itertools.pairwise(bounds):
        pos = kwargs.get("position_ids")
        alone.append(net(input_ids=ids[:, s:e], position_ids=None if pos is None else pos[:, s:e]).logits)
    assert torch.allclose(logits, torch.cat(alone, 1), atol=1e-10, rtol=0)


_NET = {}


def _hypothesis_net():
    if "net" not in _NET:
        _NET["net"] = tiny.build("qwen3_5", "npu")
    return _NET["net"]


def _padded_rows(lengths, seed=5):
    """Left-padded rows [B, L], their padding mask, and positions clipped as verl writes them
    (``clip(cumsum(mask) - 1, min=0)``: every pad at position 0, then 0, 1, ... on the real tokens)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths) + 3
    rows = [torch.randint(1, tiny.VOCAB, (n,), generator=gen) for n in lengths]
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.arange(width) >= width - len(r) for r in rows]).long()
    return rows, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("lengths", [[7], [7, 12]], ids=["one_row", "two_rows"])
def test_left_padding_with_positions_restarting_under_a_padding_mask_is_a_padded_batch(lengths):
    """Zeros on every pad and again on the first real token are padding, which the mask says, not packing."""
    net = tiny.build("qwen3_5", "gpu").eval()
    rows, ids, mask, positions = _padded_rows(lengths)
    logits = net(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    for b, row in enumerate(rows):
        alone = net(input_ids=row.unsqueeze(0)).logits[0]
        assert torch.allclose(logits[b, -len(row):], alone, atol=1e-10, rtol=0)


@pytest.mark.parametrize("marks", ["position_ids", "seq_idx"])
@pytest.mark.parametrize("mask", [None, "ones"])
def test_a_batch_of_rows_each_packed_by_restarting_position_ids_is_refused(mask, marks):
    """[B > 1, L] rows whose positions restart inside a row hold several sequences each; run as one sequence per
    row, their linear-attention layers would mix those sequences silently."""
    net = tiny.build("qwen3_5", "gpu")
    ids = torch.randint(0, tiny.VOCAB, (2, 12))
    positions = torch.cat([torch.arange(5), torch.arange(7)])
    seq_idx = torch.tensor([0] * 5 + [1] * 7).expand(2, -1).int()
    kwargs = {"position_ids": positions.expand(2, -1)} if marks == "position_ids" else {"seq_idx": seq_idx}
    if mask == "ones":
        kwargs["attention_mask"] = torch.ones_like(ids)
    with pytest.raises(PackedMetadataError, match=rf"{marks} of a batch of 2 rows start a new sequence inside row 0 "
                                                  r"\(at token 5\).* one row \[1, T\]"):
        net(input_ids=ids, **kwargs)


def test_sequence_indices_that_disagree_with_the_positions_are_refused():
    """``seq_idx`` (DataCollatorWithFlattening(return_seq_idx=True)) and restarting positions must mark the same
    sequences."""
    net = tiny.build("qwen3_5", "gpu")
    ids, _, positions = _row()
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).unsqueeze(0).int()
    seq_idx[0, 23:25] = 0  # the second sequence starts two tokens late
    with pytest.raises(PackedMetadataError, match=r"position_ids \(from seq_idx\) disagree .* token 23 has position 0, expected 23"):
        net(input_ids=ids, position_ids=positions, seq_idx=seq_idx)


@pytest.mark.parametrize("flag", [False, True])
def test_sequence_indices_that_disagree_with_cu_seq_lens_are_refused(flag):
    """With ``cu_seq_lens_q`` given, ``seq_idx`` (DataCollatorWithFlattening with both return_flash_attn_kwargs and
    return_seq_idx) was never read: a disagreeing one passed silently, while disagreeing positions were refused."""
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
    ids, cu, _ = _row()
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).unsqueeze(0).int()
    net(input_ids=ids, seq_idx=seq_idx, **tiny.packed_kwargs(cu))  # agreeing: accepted
    seq_idx[0, 23:25] = 0
    with pytest.raises(PackedMetadataError, match=r"seq_idx .* disagrees with cu_seq_lens_q \[0, 23, 28, 68, 69\]"):
        net(input_ids=ids, seq_idx=seq_idx, **tiny.packed_kwargs(cu))


def test_a_row_packed_by_position_ids_with_a_padded_tail_is_refused():
    """A restart on a real token marks a sequence even under a padding mask: such a row is packed, and packed rows
    carry no padding."""
    net = tiny.build("qwen3_5", "gpu")
    ids, _, positions = _row()
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    positions = torch.cat([positions, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = (torch.arange(padded.shape[1]) < ids.shape[1]).long().unsqueeze(0)
    with pytest.raises(ValueError, match="attention_mask with padding on a packed row"):
        net(input_ids=padded, attention_mask=mask, position_ids=positions)


def _call(net, callee):
    return net if callee == "model" else net.model


@pytest.mark.parametrize("callee", ["model", "backbone"])
@pytest.mark.parametrize("name", ["max_length_q", "max_length_k"])
@pytest.mark.parametrize("flag", [False, True])
def test_a_max_length_shorter_than_the_longest_sequence_is_refused(flag, name, callee):
    """Flash-style varlen kernels launch max_length_q / block queries per sequence: a short one leaves the later
    tokens uncomputed, silently (CPU's reference attention ignores it, so only the check can tell)."""
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
    ids, cu, _ = _row()
    longest = max(LENGTHS)
    kwargs = {**tiny.packed_kwargs(cu), name: longest - 1}
    with pytest.raises(PackedMetadataError, match=(
        rf"{name}={longest - 1} is shorter than the longest sequence of the packed row \({longest} tokens; "
        rf"boundaries \[0, 23, 28, 68, 69\]\).* Pass {name}={longest}"
    )):
        _call(net, callee)(input_ids=ids, **kwargs)


def test_a_max_length_shorter_than_a_sequence_of_restarting_positions_is_refused():
    net = tiny.build("qwen3_5", "gpu")
    ids, _, positions = _row()
    with pytest.raises(PackedMetadataError, match="max_length_q=10 is shorter than the longest sequence"):
        net(input_ids=ids, position_ids=positions, max_length_q=10)


@pytest.mark.parametrize("flag", [False, True])
def test_a_max_length_longer_than_the_longest_sequence_is_accepted(flag):
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
    ids, cu, _ = _row()
    roomy = {**tiny.packed_kwargs(cu), "max_length_q": ids.shape[1], "max_length_k": ids.shape[1]}
    assert torch.equal(net(input_ids=ids, **roomy).logits, net(input_ids=ids, **tiny.packed_kwargs(cu)).logits)


@pytest.mark.parametrize("callee", ["model", "backbone"])
@pytest.mark.parametrize("flag", [False, True])
def test_input_ids_without_the_batch_dimension_are_refused_naming_the_fix(flag, callee):
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
    ids, cu, _ = _row()
    with pytest.raises(PackedMetadataError, match=(
        r"input_ids of shape \(69,\) with cu_seq_lens_q has no batch dimension: the model takes rows \[batch, T\], "
        r"and a packed row is one row \[1, T\] holding every sequence. Pass input_ids.unsqueeze\(0\)"
    )):
        _call(net, callee)(input_ids=ids[0], **tiny.packed_kwargs(cu))


def test_inputs_embeds_without_the_batch_dimension_are_refused_naming_the_fix():
    net = tiny.build("qwen3_5", "gpu")
    ids, cu, _ = _row()
    embeds = net.get_input_embeddings()(ids)[0]
    with pytest.raises(PackedMetadataError, match=r"inputs_embeds of shape \(69, 32\) .*Pass inputs_embeds.unsqueeze\(0\)"):
        net(inputs_embeds=embeds, **tiny.packed_kwargs(cu))
