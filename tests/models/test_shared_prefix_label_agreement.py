"""A shared row is scored once, against one label: what its members' labels must agree on, and what happens when
they do not (the call is scored packed, with a `SharedPrefixLabels` warning, never silently wrong)."""

import warnings

import numpy as np
import pytest
import torch
from patchgen.kernels.modeling.host_rows import HostRow
from patchgen.kernels.modeling.lm_head import SharedPrefixLabels, _host_targets, _labels_disagree
from patchgen.kernels.shared_prefix import build_plan
from patchgen.kernels.shared_prefix.lm_rows import first_disagreement

from tests.models import tiny

PROMPT, RESPONSES = 70, [10, 11, 12]


def _batch():
    ids, cu, prompt = tiny.grpo_batch([(PROMPT, RESPONSES)], seed=3)
    return ids, cu, prompt


def _next_ids(ids, cu):
    """shift_labels: each position's next token, -100 at every sequence's last position."""
    labels = torch.full_like(ids, -100)
    labels[0, :-1] = ids[0, 1:]
    labels[0, cu[1:] - 1] = -100
    return labels


def _cases(ids, cu):
    """(name, shift_labels, whether its members agree) over the ways a trainer labels a GRPO group."""
    agree = _next_ids(ids, cu)
    masked_prompt = agree.clone()
    masked_prompt[0, cu[1] : cu[1] + PROMPT] = -100  # one rollout's prompt not scored: still one label per row
    differs = agree.clone()
    differs[0, cu[1] + 30] = (differs[0, cu[1] + 30] + 1) % tiny.VOCAB  # one member's prompt label is not its next id
    return [("next ids", agree, True), ("one prompt masked", masked_prompt, True), ("a prompt label differs", differs, False)]


def test_the_host_and_the_device_checks_give_the_same_answer():
    ids, cu, _ = _batch()
    plan = build_plan(ids, cu, conv_kernel_size=4)
    for name, shift_labels, agree in _cases(ids, cu):
        on_device = not bool(plan.lm_rows(shift_labels).disagree())
        on_host = first_disagreement(plan.lm.host_inverse, plan.lm.length, shift_labels.reshape(-1).numpy()) is None
        assert on_device == on_host == agree, name


def test_a_host_row_is_checked_on_its_host_copy_and_any_other_on_the_device():
    ids, cu, _ = _batch()
    plan = build_plan(ids, cu, conv_kernel_size=4)
    length = int(cu[-1])
    agreeing = _cases(ids, cu)[0][1]
    for name, shift_labels, agree in _cases(ids, cu):
        host = HostRow(ids, None, cu, None, shift_labels)
        # the host copy decides, and says where: the device's labels (here the agreeing ones) are not read
        found = _labels_disagree(_host_targets(host, 1, length), plan, plan.lm_rows(agreeing))
        # the row both members share: position 30 of the first and of the second sequence (one of them differs from
        # the label the entry scores, the larger)
        assert found is None if agree else found in (30, int(cu[1]) + 30), name
        # no host copy: the device decides, and does not look the position up
        assert _labels_disagree(None, plan, plan.lm_rows(shift_labels)) == (None if agree else -1), name


def _train(flag, model="qwen3_5", **labels):
    extra = {"output_router_logits": True} if model == "qwen3_5_moe" else {}
    net = tiny.build(model, "gpu", shared_prefix_training=flag, **extra)
    ids, cu, _ = _batch()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = net(input_ids=ids, return_log_probs=True, return_entropy=True, **tiny.packed_kwargs(cu), **labels)
    out.loss.backward()
    # reported where this file called the model, not inside transformers' wrappers
    assert all(w.filename == __file__ for w in seen if w.category is SharedPrefixLabels)
    return out, tiny.grads(net), [w.category for w in seen]


@pytest.mark.parametrize(("model", "how"), [("qwen3_5", "labels"), ("qwen3_5", "shift_labels"), ("qwen3_5_moe", "labels")])
def test_labels_that_differ_inside_the_shared_prompt_train_as_packed_and_say_so(model, how, request):
    if model == "qwen3_5_moe":
        request.getfixturevalue("float64_router")  # upstream's float32 router softmax would blur float64 equality
    ids, cu, _ = _batch()
    shift_labels = _cases(ids, cu)[2][1]
    if how == "labels":  # upstream's labels: the position's own token, shifted by the head
        given = ids.clone()
        given[0, cu[1] + 31] = (given[0, cu[1] + 31] + 1) % tiny.VOCAB
        kwargs = {"labels": given}
    else:
        kwargs = {"shift_labels": shift_labels}
    packed, packed_grads, _ = _train(False, model, **kwargs)
    shared, shared_grads, warned = _train(True, model, **kwargs)
    assert SharedPrefixLabels in warned
    assert torch.allclose(shared.loss, packed.loss, rtol=0, atol=1e-12)  # with the MoE's load-balancing loss
    assert torch.allclose(shared.log_probs, packed.log_probs, rtol=0, atol=1e-12)
    assert torch.allclose(shared.entropy, packed.entropy, rtol=0, atol=1e-12)
    tiny.assert_grads_close(shared_grads, packed_grads)


def test_agreeing_labels_keep_the_shared_head_and_warn_nothing():
    ids, cu, _ = _batch()
    for name, shift_labels, agree in _cases(ids, cu):
        if not agree:
            continue
        packed, packed_grads, _ = _train(False, shift_labels=shift_labels)
        shared, shared_grads, warned = _train(True, shift_labels=shift_labels)
        assert SharedPrefixLabels not in warned, name
        assert torch.allclose(shared.loss, packed.loss, rtol=0, atol=1e-12), name
        tiny.assert_grads_close(shared_grads, packed_grads)


def test_the_check_counts_the_largest_label_an_entry_scores():
    # an entry serves positions 0 and 2, another position 1: 5 and -100 agree (ignored), 5 and 6 do not, and the
    # position that differs from its entry's label (the largest, 6) is 0
    inverse = np.array([0, 1, 0])
    assert first_disagreement(inverse, 2, np.array([5, 7, -100])) is None
    assert first_disagreement(inverse, 2, np.array([5, 7, 6])) == 0
