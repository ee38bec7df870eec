"""A float32 training step of the npu modules on torch_npu's operators equals the reference backends.

Packed rows and shared-prefix rows, dense and MoE: loss, logits and every parameter gradient. The
GDN, conv and gated-norm slots run the torch reference on both sides (our Triton kernels have
their own tests), so the difference is exactly the torch_npu backends.
"""

import pytest
import torch

from tests.models import tiny

SLOW_ON_CPU = {"gated_delta_rule": "torch", "causal_conv1d": "torch", "rms_norm_gated": "torch"}
REFERENCE = {**SLOW_ON_CPU, "rms_norm": "torch", "rotary": "torch", "swiglu_mlp": "torch", "attention": "eager",
             "moe_experts": "eager", "cross_entropy": "chunked"}
NPU_BACKENDS = {"rms_norm": "npu_rms_norm", "rotary": "npu_rotary_mul", "swiglu_mlp": "npu_swiglu",
                "attention": "npu_fusion_attention", "moe_experts": "npu_grouped_matmul"}
# float32 end to end; the two sides round differently (fused GEMMs, per-segment softmax), nothing more.
ATOL = 1e-5
GROUPS = [(24, [6, 9, 4]), (17, [3, 1])]  # two GRPO groups of rollouts sharing a prompt
SINGLES = [12]
MIN_PREFIX = 8  # shared_prefix_min_length: prompts this long are computed once


def build(model, device, ops_implementation, **extra):
    mod = tiny.module(model, "npu")
    config = tiny.text_config(model, ops_implementation=ops_implementation, **extra)
    torch.manual_seed(0)
    net = getattr(mod, tiny.PREFIX[model] + "ForCausalLM")(config).float()
    return tiny.randomize(net).to(device)


def step(net, ids, cu, labels, device):
    out = net(input_ids=ids.to(device), labels=labels.to(device), **tiny.packed_kwargs(cu.to(device)))
    out.loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in net.named_parameters() if p.grad is not None}
    return out.loss.detach().cpu(), out.logits.detach().cpu(), grads


def both(npu, model, ids, cu, labels, **extra):
    on_npu = build(model, npu.device, SLOW_ON_CPU, **extra)
    table = on_npu._patchgen_ops
    expected = {s: b for s, b in NPU_BACKENDS.items() if model == "qwen3_5_moe" or s != "moe_experts"}
    assert {s: table.backend(s) for s in expected} == expected
    result = step(on_npu, ids, cu, labels, npu.device)
    assert {name for name, _ in npu.calls} >= set(expected.values())
    reference = step(build(model, "cpu", REFERENCE, **extra), ids, cu, labels, "cpu")
    return result, reference


def assert_equal_steps(result, reference):
    (loss, logits, grads), (ref_loss, ref_logits, ref_grads) = result, reference
    assert torch.allclose(loss, ref_loss, atol=ATOL, rtol=0)
    assert torch.allclose(logits, ref_logits, atol=ATOL, rtol=0), f"{(logits - ref_logits).abs().max():.2e}"
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        scale = max(1.0, ref_grads[name].abs().max().item())
        diff = (grads[name] - ref_grads[name]).abs().max().item()
        assert diff <= ATOL * scale, f"{name}: max diff {diff:.2e}"


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_packed_step_equals_the_reference_backends(npu, model):
    ids, cu = tiny.packed_batch([37, 5, 70, 1], seed=2)
    assert_equal_steps(*both(npu, model, ids, cu, ids))


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_shared_prefix_step_equals_the_reference_backends(npu, model):
    ids, cu, prompt = tiny.grpo_batch(GROUPS, SINGLES, seed=7)
    labels = ids.masked_fill(prompt, -100)
    result, reference = both(npu, model, ids, cu, labels, shared_prefix_training=True,
                             shared_prefix_min_length=MIN_PREFIX)
    # the compact row really went through the operator: suffix segments read more keys than queries
    q_ends, k_ends = zip(*((c["actual_seq_qlen"], c["actual_seq_kvlen"]) for c in npu.called("npu_fusion_attention")))
    assert any(q != k for q, k in zip(q_ends, k_ends))
    assert_equal_steps(result, reference)


@pytest.mark.parametrize("case", ["flag off, boundaries made in the scoring loop", "flag off, int64 boundaries",
                                  "flag on, plan reuse off"])
def test_scoring_in_inference_mode_then_training_the_same_row(npu, case):
    """RL scores a micro-batch under inference mode (reference log-probs), then trains on it. Boundaries made in
    inference mode have no version counter for the attention backend's host cache, and the causal mask it keeps
    must not be an inference tensor (the operator's backward saves it)."""
    import importlib

    from tests.npu.conftest import ADAPTERS

    importlib.import_module(ADAPTERS + "fusion_attention")._masks.clear()  # the first call builds it: in inference mode
    ids, cu, _ = tiny.grpo_batch(GROUPS, SINGLES)
    extra = {"shared_prefix_training": case.startswith("flag on"), "shared_prefix_min_length": MIN_PREFIX,
             "shared_prefix_plan_reuse": False}
    net = build("qwen3_5", npu.device, SLOW_ON_CPU, **extra)
    with torch.inference_mode():
        scored_cu = cu.clone() if "scoring loop" in case else cu.long() if "int64" in case else cu
        scored = net(input_ids=ids.to(npu.device), **tiny.packed_kwargs(scored_cu.to(npu.device))).logits.clone()
    mask = importlib.import_module(ADAPTERS + "fusion_attention").causal_mask(npu.device)
    assert not mask.is_inference()
    loss, logits, _ = step(net, ids, cu, ids, npu.device)
    assert torch.equal(scored.cpu(), logits) and torch.isfinite(loss)
