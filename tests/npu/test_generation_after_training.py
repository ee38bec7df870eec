"""A user's flow on the npu module with torch_npu's operators: load a checkpoint upstream saved, train
a few steps with shared prefixes, then generate with the same model object. The tokens equal those of
upstream's own class loaded from the trained weights (greedy, a left-padded batch and one unpadded
row, with and without a cache); a plain training forward runs npu_fusion_attention too."""

import pytest
import torch

from tests.models import checkpoints as ckpt
from tests.models import tiny

PAD = 0
# the slow-on-CPU slots on the torch references (our Triton kernels have their own tests)
TORCH_MIXERS = {"gated_delta_rule": "torch", "causal_conv1d": "torch", "rms_norm_gated": "torch"}


def _load(model, path, device):
    return ckpt.generated_class(model, "npu", "ForCausalLM").from_pretrained(
        path, shared_prefix_training=True, shared_prefix_min_length=8, ops_implementation=TORCH_MIXERS
    ).to(device)


def _train_steps(net, device, steps=2):
    ids, cu, prompt = tiny.grpo_batch([(20, [3, 1, 5])], singles=[9], seed=11)
    labels = ids.masked_fill(prompt, -100)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    net.train()
    for _ in range(steps):
        net(input_ids=ids.to(device), labels=labels.to(device), **tiny.packed_kwargs(cu.to(device))).loss.backward()
        opt.step()
        opt.zero_grad()


def _generate(net, ids, mask, use_cache):
    out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=use_cache,
                       eos_token_id=None, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.logits).cpu()


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_generation_after_training_equals_upstream_from_the_trained_weights(npu, model, tmp_path):
    ckpt.save_upstream(model, "ForConditionalGeneration", tmp_path / "published")
    net = _load(model, tmp_path / "published", npu.device)
    _train_steps(net, npu.device)
    assert {name for name, _ in npu.calls} >= {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"}
    net.save_pretrained(tmp_path / "trained")
    extra = {"experts_implementation": "eager"} if model == "qwen3_5_moe" else {}
    upstream = ckpt.upstream_class(model, "ForCausalLM").from_pretrained(tmp_path / "trained", **extra).eval()
    upstream.config.output_router_logits = False  # upstream's MoE generate fails on a padding mask with it on
    ids, mask = tiny.left_padded_batch((5, 14, 9), pad=PAD)
    for rows, rows_mask in ((ids, mask), (ids[1:2], mask[1:2])):  # left-padded batch; one row, no padding
        expected, expected_logits = _generate(upstream, rows, rows_mask, True)
        for use_cache in (True, False):  # the model is still in training mode, as a trainer leaves it
            tokens, logits = _generate(net, rows.to(npu.device), rows_mask.to(npu.device), use_cache)
            assert torch.equal(tokens, expected)
            # float32 both sides; upstream's own kernels round differently from torch_npu's operators
            torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=0)


def test_a_plain_training_forward_runs_npu_fusion_attention(npu, tmp_path):
    """Unpacked rows without padding: attention through the slot's backend, each row one sequence."""
    ckpt.save_upstream("qwen3_5", "ForCausalLM", tmp_path / "ckpt")
    net = _load("qwen3_5", tmp_path / "ckpt", npu.device).train()
    ids = torch.randint(2, tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0)).to(npu.device)
    net(input_ids=ids, labels=ids).loss.backward()
    calls = npu.called("npu_fusion_attention")
    assert len(calls) == net.config.layer_types.count("full_attention")
    assert all(c["actual_seq_qlen"] == [12, 24] and c["actual_seq_kvlen"] == [12, 24] for c in calls)
