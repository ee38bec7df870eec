"""A user of the npu target, end to end on its default kernels: prefix trees through our Triton GDN and conv.

A checkpoint saved by upstream's own class, loaded into the generated npu class in float32 (torch_npu
faked on the CPU, our Triton kernels under the interpreter): on a packed row that is a prefix tree
(a system prompt over two prompts x rollouts, and a three-turn agentic conversation), shared-prefix
training on equals off in the loss, every per-token log-prob and every parameter gradient; the joint
GDN rounds and the conv look-back read from x (both default-on) are what ran, not a fallback; and
after one optimizer step the model still generates what upstream's class generates from its weights.
"""

import pytest
import torch
from patchgen.kernels.modeling.shared_prefix import observe_plans
from patchgen.kernels.triton.causal_conv1d_state import LookBack
from patchgen.kernels.triton.gated_delta_rule.rounds import JointRounds

from tests.models import checkpoints as ckpt
from tests.models import tiny
from tests.models.prefix_trees import pack, prompt_mask

TRITON_SLOTS = ("gated_delta_rule", "causal_conv1d", "rms_norm_gated")
TREE_CONFIG = {"shared_prefix_max_depth": 4, "shared_prefix_level_cost": 0}
# float32 on both sides; they differ in summation order only (the compact row, the joint rounds)
ATOL = 1e-5


def tree_batch(seed=0):
    """Root-to-leaf sequences in a scrambled packed order, and the rows above each one's leaf.

    System prompt (65) -> prompts of 63 and 64 -> rollouts (one of a single row); an agentic root (64)
    -> turn 1 (65) -> turn 2 (64), a sequence ending after each turn; one unshared sequence. Node ends fall
    off the 64-row chunk grid (65, 128, 129, 193) and a 63-row node sits between two levels.
    """
    gen = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(0, tiny.VOCAB, (n,), generator=gen).tolist()

    system, prompt_a, prompt_b = toks(65), toks(63), toks(64)
    root, turn1, turn2 = toks(64), toks(65), toks(64)
    pairs = [
        (system + prompt_a + toks(1), 128),
        (system + prompt_a + toks(4), 128),
        (system + prompt_b + toks(3), 129),
        (system + prompt_b + toks(2), 129),
        (root + toks(2), 64),
        (root + turn1 + toks(1), 129),
        (root + turn1 + turn2 + toks(3), 193),
        (root + turn1 + turn2 + toks(2), 193),
        (toks(9), 0),
    ]
    order = [5, 0, 8, 3, 1, 7, 2, 4, 6]
    return [pairs[i][0] for i in order], [pairs[i][1] for i in order]


class Spies:
    """Counts of calls into the default-on shared-prefix stages of our Triton backend."""

    def __init__(self, monkeypatch):
        self.calls = {}
        for cls, name in [(JointRounds, "forward_rounds"), (JointRounds, "backward_rounds"),
                          (LookBack, "forward"), (LookBack, "backward")]:
            monkeypatch.setattr(cls, name, self._counting(f"{cls.__name__}.{name}", getattr(cls, name)))

    def _counting(self, key, fn):
        def counted(*args, **kwargs):
            self.calls[key] = self.calls.get(key, 0) + 1
            return fn(*args, **kwargs)

        return counted


def save_upstream(model, path):
    """Upstream's own ForCausalLM saved to `path`: one linear-attention layer (two GDN heads over one
    key head) and one attention layer, so the interpreter runs few kernel programs."""
    layers = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    config = tiny.text_config(model, linear_num_key_heads=1, linear_num_value_heads=2, **layers)
    torch.manual_seed(0)
    net = ckpt.upstream_class(model, "ForCausalLM")(config)
    tiny.randomize(net)
    net.save_pretrained(path)
    return net


def load(model, path, flag):
    cls = ckpt.generated_class(model, "npu", "ForCausalLM")
    net = cls.from_pretrained(path, dtype=torch.float32, shared_prefix_training=flag, **TREE_CONFIG)
    table = net._patchgen_ops
    assert {s: table.choice_for(s, torch.float32).backend for s in TRITON_SLOTS} == dict.fromkeys(TRITON_SLOTS, "triton")
    return net.train()


def step(net, kwargs, ids):
    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        out = net(**kwargs)
    out.loss.backward()
    logp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
    return out.loss.detach(), logp.detach(), grads, plans


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_tree_training_on_the_npu_defaults_equals_packed_and_generates_as_upstream(npu, model, tmp_path,
                                                                                   monkeypatch):
    if npu.real:
        pytest.skip("checks the Triton interpreter on the CPU; on an NPU the same kernels run compiled")
    upstream = save_upstream(model, tmp_path)
    seqs, prompt_lengths = tree_batch()
    ids, cu = pack(seqs)
    labels = ids.masked_fill(prompt_mask(seqs, prompt_lengths), -100)
    kwargs = dict(input_ids=ids, labels=labels, **tiny.packed_kwargs(cu))

    spies = Spies(monkeypatch)
    off = step(load(model, tmp_path, False), kwargs, ids)
    assert spies.calls == {}, "packed training must not take the shared-prefix stages"
    net = load(model, tmp_path, True)
    on = step(net, kwargs, ids)

    # the model ran the tree (two levels under the system prompt, three in the agentic turns) ...
    (plan,) = on[3]
    assert plan is not None and plan.depth == 3 and plan.compact_length < plan.packed_length
    assert sorted(n.end - n.start for n in plan.nodes) == [64, 64, 64, 65, 65]  # off the chunk grid
    # ... through the joint rounds and the look-back read from x, once per linear-attention layer each way
    linear = sum(t == "linear_attention" for t in net.config.layer_types)
    assert spies.calls == {"JointRounds.forward_rounds": linear, "JointRounds.backward_rounds": linear,
                           "LookBack.forward": linear, "LookBack.backward": linear}
    assert {name for name, _ in npu.calls} >= {"npu_fusion_attention", "npu_rms_norm"}

    (loss_on, logp_on, grads_on, _), (loss_off, logp_off, grads_off, _) = on, off
    torch.testing.assert_close(loss_on, loss_off, atol=ATOL, rtol=0)
    torch.testing.assert_close(logp_on, logp_off, atol=ATOL, rtol=0)
    assert grads_on.keys() == grads_off.keys() and len(grads_on) == len(dict(net.named_parameters()))
    for name in grads_on:
        scale = max(1.0, grads_off[name].abs().max().item())
        diff = (grads_on[name] - grads_off[name]).abs().max().item()
        assert diff <= ATOL * scale, f"{name}: max diff {diff:.2e}"

    # one step of training, then greedy decoding with the cache equals upstream's class on those weights
    with torch.no_grad():
        for p in net.parameters():
            p.sub_(1e-2 * p.grad)
    upstream.load_state_dict(net.state_dict())
    prompt = torch.randint(0, tiny.VOCAB, (1, 7), generator=torch.Generator().manual_seed(4))
    generate = dict(max_new_tokens=6, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    ours = net.eval().generate(input_ids=prompt, **generate)
    theirs = upstream.float().eval().generate(input_ids=prompt, **generate)
    assert torch.equal(ours, theirs)
