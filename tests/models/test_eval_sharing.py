"""Scoring a packed row in eval mode or under no_grad (an old-policy or reference pass, evaluation) shares
prefixes on every class of both models, with a published config's ``use_cache=True``, and builds no cache.

Before, ``ForConditionalGeneration`` (the class Qwen3.5 and Qwen3.5-MoE checkpoints are published as) read
the config's ``use_cache`` as a request for a cache there and silently ran such rows unshared; ``ForCausalLM``
shared. The MoE class kept its own copy of that forward, and so the fault, after the dense one was mended.
"""

import pytest
import torch
from patchgen.kernels.modeling.shared_prefix import observe_plans

from tests.models import tiny


def _build(model, cls, flag):
    build = tiny.build if cls == "ForCausalLM" else tiny.build_conditional
    return build(model, "gpu", shared_prefix_training=flag, use_cache=True)


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("cls", ["ForCausalLM", "ForConditionalGeneration"])
@pytest.mark.parametrize("mode", ["eval", "train, no_grad"])
def test_a_packed_row_scored_outside_a_training_step_shares_and_keeps_no_cache(model, cls, mode):
    ids, cu, prompt = tiny.grpo_batch([(70, [4, 1, 6])], singles=[9], seed=2)
    kwargs = dict(input_ids=ids, labels=ids.masked_fill(prompt, -100), return_log_probs=True, **tiny.packed_kwargs(cu))
    outs, plans = {}, []
    for flag in (False, True):
        net = _build(model, cls, flag).train(mode != "eval")
        with torch.no_grad(), observe_plans(lambda plan, tokens, flag=flag: plans.append((flag, plan))):
            outs[flag] = net(**kwargs)
    shared = [plan for flag, plan in plans if flag]
    assert len(shared) == 1 and shared[0] is not None and shared[0].compact_length < shared[0].packed_length
    assert outs[True].past_key_values is None
    assert torch.allclose(outs[True].logits, outs[False].logits, atol=1e-12, rtol=0)
    assert torch.allclose(outs[True].log_probs, outs[False].log_probs, atol=1e-12, rtol=0)
    assert torch.allclose(outs[True].loss, outs[False].loss, atol=1e-12, rtol=0)
