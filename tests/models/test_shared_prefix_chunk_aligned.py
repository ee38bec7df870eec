"""Chunk-aligned sharing (`shared_prefix_chunk_aligned`): flag on vs off, float64 on CPU.

Prefixes are cut back to multiples of 64 and the compact row is laid out level by level, so the GDN
rounds read it in place; logits, loss and every parameter gradient must still equal packed training.
"""

import pytest
import torch
from patchgen.kernels.modeling.shared_prefix import observe_plans

from tests.models import tiny
from tests.models.test_shared_prefix_tree import check_tree

# prefixes 80 and 70 (cut to 64 each), a singleton in between the groups' responses
GROUPS = [(80, [10, 20, 15]), (70, [5, 1])]
SINGLES = [30]


def _run(flag, kwargs, checkpointing=False):
    net = tiny.build("qwen3_5", "gpu", seed=0, shared_prefix_training=flag, shared_prefix_chunk_aligned=True)
    if checkpointing:
        net.activation_checkpointing_enable()
        net.train()
    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        out = net(**kwargs)
    out.loss.backward()
    return out, tiny.grads(net), plans


@pytest.mark.parametrize(
    "masked,checkpointing", [(True, False), (False, True)], ids=["prompt-masked", "prompt-labelled-checkpointed"]
)
def test_chunk_aligned_plan_matches_packed(masked, checkpointing):
    ids, cu, prompt = tiny.grpo_batch(GROUPS, SINGLES, seed=7)
    labels = ids.masked_fill(prompt, -100) if masked else ids
    kwargs = dict(input_ids=ids, labels=labels, **tiny.packed_kwargs(cu))
    off, g_off, _ = _run(False, kwargs, checkpointing)
    on, g_on, plans = _run(True, kwargs, checkpointing)
    (plan,) = plans
    assert plan.gdn.src_identity and plan.gdn.out_identity  # what the option is for
    assert plan.compact_length == ids.shape[1] - (3 - 1) * 64 - (2 - 1) * 64
    torch.testing.assert_close(on.logits, off.logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(on.loss, off.loss, atol=1e-12, rtol=0)
    tiny.assert_grads_close(g_on, g_off)


def test_chunk_aligned_three_level_tree_matches_packed(float64_router, monkeypatch):
    gen = torch.Generator().manual_seed(5)

    def toks(n):
        return torch.randint(0, tiny.VOCAB, (n,), generator=gen).tolist()

    root, turn1, turn2 = toks(70), toks(65), toks(64)
    seqs = [root + toks(2), root + turn1 + toks(1), root + turn1 + turn2 + toks(3), root + turn1 + turn2 + toks(2)]
    build = tiny.build
    monkeypatch.setattr(tiny, "build", lambda *a, **k: build(*a, shared_prefix_chunk_aligned=True, **k))
    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        check_tree("qwen3_5", "gpu", (seqs, [70, 135, 199, 199], None), masked=True)
    plan = plans[-1]
    assert plan.depth == 3 and plan.gdn.src_identity
    assert [(n.start, n.end) for n in plan.nodes] == [(0, 64), (64, 128), (128, 192)]
