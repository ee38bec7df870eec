"""A packed row handed to the GPU model on the host (`kernels/modeling/host_rows.py`): the same log-probs and loss,
bit for bit, as the row handed over on the device, packed and shared. With shared prefixes the call has no host
sync at all (a row on the device costs the copies back of its boundaries and its ids, and the head's count of
its labelled rows), so a scoring loop queues micro-batch k + 1 while the device still runs micro-batch k. The packed path spares the boundaries' copy;
its layers' backends may still sync on their own.

Generated GPU module, 4 layers (3 GDN + 1 attention) at Qwen3.5-4B head widths, bf16, real backends.
Skipped without CUDA.
"""

import importlib
import warnings

import pytest
import torch

from tests.models import tiny

pytestmark = pytest.mark.gpu

MODULE = "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu"
WIDTHS = dict(
    hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=8192,
)
GROUPS = [(700, [90, 300, 128, 64])]


@pytest.fixture(scope="module")
def model():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
        use_cache=False, **WIDTHS,
    )
    config.shared_prefix_plan_reuse = False  # every call plans: the device-row call must copy back to do it
    torch.manual_seed(0)
    module = importlib.import_module(MODULE)
    with torch.device("cuda"):
        net = module.Qwen3_5ForCausalLM(config).bfloat16()
    return net.eval(), module


def _row():
    ids, cu, prompt = tiny.grpo_batch(GROUPS, [], seed=5, vocab=WIDTHS["vocab_size"])
    return ids, cu.to(torch.int32), ids.masked_fill(prompt, -100)


def _score(net, ids, cu, labels, longest):
    """`longest` comes from the host boundaries: read from a device `cu` it would be a sync of the test's own."""
    with torch.no_grad():
        out = net(input_ids=ids, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                  max_length_k=longest, return_log_probs=True, return_logits=False)
    return out.log_probs.float(), out.loss.float()


def _is_sync(warning) -> bool:
    # the mode's one-time notice that it is a prototype says "synchronizing" too
    return "synchronizing" in str(warning.message) and "prototype" not in str(warning.message)


def _syncs(net, module, call):
    """Run `call()`; the host syncs torch reported before the LM head began, and in the whole call."""
    seen = []
    head = module.causal_lm_head

    def counting_head(*args, **kwargs):
        seen.append(sum(map(_is_sync, caught)))
        return head(*args, **kwargs)

    module.causal_lm_head = counting_head
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        module.causal_lm_head = head
    return seen[0], sum(map(_is_sync, caught)), out


@pytest.mark.parametrize("shared", [False, True])
def test_a_row_handed_over_on_the_host_scores_as_on_the_device_with_fewer_syncs(model, shared):
    net, module = model
    net.config.shared_prefix_training = shared
    ids, cu, labels = _row()
    longest = int((cu[1:] - cu[:-1]).max())
    on_device = [t.cuda() for t in (ids, cu, labels)]
    _score(net, *on_device, longest)  # warm: plans, tuning, verification
    _score(net, ids, cu, labels, longest)
    # new tensors, as every micro-batch of a loop brings: a backend may keep what it derived per boundaries
    # tensor, and a tensor it saw before would spare the device row a copy back that a real loop pays
    fresh = [t.clone() for t in on_device]
    device_syncs, _, (lp_device, loss_device) = _syncs(net, module, lambda: _score(net, *fresh, longest))
    host_syncs, whole_call, (lp_host, loss_host) = _syncs(net, module, lambda: _score(net, ids, cu, labels, longest))
    assert torch.equal(lp_host, lp_device) and torch.equal(loss_host, loss_device)
    assert host_syncs < device_syncs  # the count sees the copies back a row on the device costs
    if shared:
        # none at all: the head counts the labelled rows on the host copy of the labels, and reads nothing back
        assert host_syncs == 0 and whole_call == 0
