"""Shared prefixes that end just past a GDN chunk or inside the conv look-back, end to end (float64, flag on
vs off): roots of 1-3 tokens (``shared_prefix_min_length=1``, so a member's first conv taps reach before
its sequence), nested nodes ending 1-3 rows past a 64-row chunk, the prompt alone as a sequence (an
empty response) and a sequence that is the nested prefix itself. Logits, loss, and every gradient to
1e-10 on both targets."""

import pytest
import torch
from patchgen.kernels.modeling.shared_prefix import observe_plans

from tests.models import tiny

# (root length, nested node length past the root; 0: no nested node)
CASES = [(1, 0), (2, 66), (3, 0), (65, 0), (66, 64), (67, 65)]


def _batch(root_length, nested, seed=0):
    gen = torch.Generator().manual_seed(seed)
    toks = lambda n: torch.randint(0, tiny.VOCAB, (n,), generator=gen).tolist()
    root, seqs = toks(root_length), []
    if nested:
        node = root + toks(nested)
        seqs += [node + toks(1), node + toks(2), node]
    seqs += [root + toks(3), root + toks(1), root]
    ids = torch.tensor([t for s in seqs for t in s]).unsqueeze(0)
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    return ids, cu


@pytest.mark.parametrize("device", ["gpu", "npu"])
def test_prefixes_ending_in_the_chunk_or_conv_window_equal_the_flag_off(device):
    nets = {
        flag: tiny.build("qwen3_5", device, seed=2, shared_prefix_training=flag, shared_prefix_min_length=1,
                         shared_prefix_max_depth=4, shared_prefix_level_cost=0)
        for flag in (False, True)
    }
    for root_length, nested in CASES:
        ids, cu = _batch(root_length, nested)
        results, plans = {}, []
        for flag, net in nets.items():
            net.zero_grad()
            with observe_plans(lambda plan, tokens, found=plans: found.append(plan)):
                out = net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))
            out.loss.backward()
            results[flag] = (out, tiny.grads(net))
        assert len(plans) == 1 and plans[0] is not None, (root_length, nested)
        assert len(plans[0].nodes) == (2 if nested else 1), (root_length, nested)
        (off, g_off), (on, g_on) = results[False], results[True]
        torch.testing.assert_close(on.logits, off.logits, atol=1e-10, rtol=0)
        torch.testing.assert_close(on.loss, off.loss, atol=1e-12, rtol=0)
        tiny.assert_grads_close(g_on, g_off)
