"""An MoE loss asked for with pre-shifted ``shift_labels`` carries the load-balancing loss, as one asked
for with ``labels`` does.

The generated forwards compute the loss from ``shift_labels`` alone (context-parallel trainers pass
them pre-shifted); the MoE bodies added ``router_aux_loss_coef * aux_loss`` only when ``labels`` were
given, so such a loss silently dropped the load-balancing term and the router got no gradient from it.
"""

import pytest
import torch
from patchgen.kernels.modeling.packing import next_token_labels

from tests.models import tiny


def _batch():
    ids, cu, prompt = tiny.grpo_batch([(70, [4, 1, 6])], singles=[12], seed=5)
    labels = ids.masked_fill(prompt, -100)
    return ids, cu, labels, next_token_labels(labels, cu)


def _build(cls, flag):
    build = tiny.build if cls == "ForCausalLM" else tiny.build_conditional
    return build("qwen3_5_moe", "gpu", shared_prefix_training=flag, output_router_logits=True)


@pytest.mark.parametrize("cls", ["ForCausalLM", "ForConditionalGeneration"])
@pytest.mark.parametrize("flag", [False, True])
def test_loss_from_shift_labels_carries_the_load_balancing_loss(float64_router, cls, flag):
    ids, cu, labels, shift_labels = _batch()
    net = _build(cls, flag)
    by_labels = net(input_ids=ids, labels=labels, **tiny.packed_kwargs(cu))
    by_shift = net(input_ids=ids, shift_labels=shift_labels, **tiny.packed_kwargs(cu))
    assert by_shift.aux_loss is not None and by_shift.aux_loss > 0
    torch.testing.assert_close(by_shift.loss, by_labels.loss, atol=1e-12, rtol=0)


def test_the_router_gets_the_load_balancing_gradient_from_a_shift_labels_loss(float64_router):
    ids, cu, labels, shift_labels = _batch()
    grads = {}
    for name, kwargs in {"labels": dict(labels=labels), "shift_labels": dict(shift_labels=shift_labels)}.items():
        net = _build("ForCausalLM", True)
        net(input_ids=ids, **kwargs, **tiny.packed_kwargs(cu)).loss.backward()
        grads[name] = tiny.grads(net)
    tiny.assert_grads_close(grads["shift_labels"], grads["labels"], atol=1e-12)
