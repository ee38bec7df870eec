"""Each torch_npu backend: called with the arguments the operator documents, and equal to the torch reference.

float32 on the fake (CPU) or the real NPU; the references run on the CPU in float64.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels.reference import attention as ref_attention
from patchgen.kernels.reference import moe_experts as ref_moe
from patchgen.kernels.reference import norms as ref_norms
from patchgen.kernels.reference import rotary as ref_rotary
from patchgen.kernels.reference import swiglu_mlp as ref_swiglu

ADAPT = "patchgen.kernels.backends."
TOL = dict(atol=2e-5, rtol=2e-5)  # float32 against a float64 reference


def adapter(name):
    return importlib.import_module(ADAPT + name)


def leaves(*shapes, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(device=device, dtype=torch.float32).requires_grad_()
            for s in shapes]


def reference_twins(*tensors):
    return [t.detach().cpu().double().requires_grad_() for t in tensors]


def assert_same(out, ref, inputs, twins):
    assert torch.allclose(out.detach().cpu().double(), ref.detach(), **TOL)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (out * weights.to(out)).sum().backward()
    (ref * weights).sum().backward()
    for a, b in zip(inputs, twins):
        assert torch.allclose(a.grad.cpu().double(), b.grad, **TOL), f"max diff {(a.grad.cpu().double() - b.grad).abs().max():.2e}"


# attention: one plain segment, an empty one, and suffix segments shorter than their keys (shared prefix)
CU_Q = [0, 7, 7, 12, 15]
CU_K = [0, 7, 7, 20, 31]


def test_fusion_attention_is_called_as_tnd_varlen_with_right_down_causal(npu):
    q, k, v = leaves((15, 4, 16), (31, 2, 16), (31, 2, 16), device=npu.device)
    cu_q = torch.tensor(CU_Q, dtype=torch.int32, device=npu.device)
    cu_k = torch.tensor(CU_K, dtype=torch.int32, device=npu.device)
    adapter("npu_fusion_attention").attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                                              max_seqlen_k=13, scale=0.25)
    (call,) = npu.called("npu_fusion_attention")
    assert call["args"][3:] == (4, "TND")  # head_num is the query heads; key heads 2: GQA by counts
    assert call["actual_seq_qlen"] == [7, 7, 12, 15] and call["actual_seq_kvlen"] == [7, 7, 20, 31]
    assert all(type(b) is int for b in call["actual_seq_qlen"] + call["actual_seq_kvlen"])
    assert call["sparse_mode"] == 3 and call["scale"] == 0.25 and call["keep_prob"] == 1.0
    mask = call["atten_mask"]
    assert mask.dtype == torch.bool and torch.equal(mask.cpu(), torch.ones(2048, 2048, dtype=torch.bool).triu(1))


def test_fusion_attention_equals_the_reference_with_bottom_right_causal_segments(npu):
    q, k, v = leaves((15, 4, 16), (31, 2, 16), (31, 2, 16), device=npu.device)
    kwargs = dict(max_seqlen_q=7, max_seqlen_k=13, scale=0.25)
    out = adapter("npu_fusion_attention").attention(
        q, k, v, cu_seqlens_q=torch.tensor(CU_Q, dtype=torch.int32, device=npu.device),
        cu_seqlens_k=torch.tensor(CU_K, dtype=torch.int32, device=npu.device), **kwargs)
    twins = reference_twins(q, k, v)
    ref = ref_attention.eager(*twins, cu_seqlens_q=torch.tensor(CU_Q), cu_seqlens_k=torch.tensor(CU_K), **kwargs)
    assert_same(out, ref, (q, k, v), twins)


def test_fusion_attention_splits_rows_of_more_segments_than_one_call_takes(npu, monkeypatch):
    module = adapter("npu_fusion_attention")
    assert module.MAX_SEGMENTS == 1024  # the documented varlen limit; 4 below keeps the test small
    monkeypatch.setattr(module, "MAX_SEGMENTS", 4)
    lengths = [1, 2, 3, 4, 5] * 2  # 10 segments
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = leaves((int(cu[-1]), 2, 8), (int(cu[-1]), 1, 8), (int(cu[-1]), 1, 8), device=npu.device)
    kwargs = dict(max_seqlen_q=5, max_seqlen_k=5, scale=0.3)
    out = module.attention(q, k, v, cu_seqlens_q=cu.to(npu.device), cu_seqlens_k=cu.to(npu.device), **kwargs)
    calls = npu.called("npu_fusion_attention")
    assert [c["actual_seq_qlen"] for c in calls] == [[1, 3, 6, 10], [5, 6, 8, 11], [4, 9]]
    twins = reference_twins(q, k, v)
    assert_same(out, ref_attention.eager(*twins, cu_seqlens_q=cu, cu_seqlens_k=cu, **kwargs), (q, k, v), twins)


def test_rms_norm_passes_one_plus_weight_as_gamma(npu):
    x, weight = leaves((3, 5, 16), (16,), device=npu.device)
    out = adapter("npu_rms_norm").rms_norm(x, weight, 1e-6)
    (call,) = npu.called("npu_rms_norm")
    assert torch.equal(call["args"][1], 1.0 + weight.float()) and call["epsilon"] == 1e-6
    twins = reference_twins(x, weight)
    assert_same(out, ref_norms.rms_norm(*twins, 1e-6), (x, weight), twins)


@pytest.mark.parametrize("width", [8, 16])  # partial rotary (Qwen3.5 rotates a quarter) and full
def test_rotary_mul_rotates_only_the_first_rotary_dims(npu, width):
    q, k = leaves((2, 4, 6, 16), (2, 2, 6, 16), device=npu.device)
    angles = torch.rand(2, 6, width // 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 6
    cos, sin = (torch.cat((f(angles), f(angles)), -1) for f in (torch.cos, torch.sin))
    out_q, out_k = adapter("npu_rotary_mul").rotary(q, k, cos.float().to(npu.device), sin.float().to(npu.device))
    calls = npu.called("npu_rotary_mul")
    assert len(calls) == 2 and all(c.get("rotary_mode", "half") == "half" for c in calls)
    assert [tuple(c["args"][0].shape) for c in calls] == [(2, 4, 6, width), (2, 2, 6, width)]
    assert tuple(calls[0]["args"][1].shape) == (2, 1, 6, width)  # B1SD cos for a BNSD input
    twins = reference_twins(q, k)
    ref_q, ref_k = ref_rotary.rotary(*twins, cos, sin)
    assert_same(torch.cat((out_q.flatten(), out_k.flatten())), torch.cat((ref_q.flatten(), ref_k.flatten())), (q, k), twins)


def test_swiglu_puts_the_gate_half_first(npu):
    x, gate, up, down = leaves((9, 16), (24, 16), (24, 16), (16, 24), device=npu.device)
    out = adapter("npu_swiglu").swiglu_mlp(x, gate, up, down)
    (call,) = npu.called("npu_swiglu")
    assert call["dim"] == -1 and call["args"][0].shape == (9, 48)
    assert torch.allclose(call["args"][0][:, :24], x @ gate.T)
    twins = reference_twins(x, gate, up, down)
    assert_same(out, ref_swiglu.swiglu_mlp(*twins), (x, gate, up, down), twins)


@pytest.mark.parametrize("act_fn", [F.silu, F.gelu])  # SiLU through npu_swiglu, any other activation unfused
def test_grouped_matmul_experts_equal_the_reference_with_exact_routing(npu, act_fn):
    hidden, gate_up, down = leaves((11, 16), (6, 2 * 12, 16), (6, 16, 12), device=npu.device)
    gen = torch.Generator().manual_seed(4)
    index = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(11)])
    index[:, 0] = torch.where(index[:, 0] == 5, 0, index[:, 0])  # expert 5 may be idle: an empty group
    index[:, 1] = torch.where(index[:, 1] == 5, 3, index[:, 1])
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 1) % 5, index[:, 1])
    weights = torch.rand(11, 2, generator=gen, dtype=torch.float64)
    out = adapter("npu_grouped_matmul").moe_experts(hidden, index.to(npu.device), weights.float().to(npu.device),
                                                    gate_up, down, act_fn)
    calls = npu.called("npu_grouped_matmul")
    assert all(c["group_type"] == 0 and c["group_list_type"] == 0 and c["split_item"] == 3 for c in calls)
    counts = torch.bincount(index.flatten(), minlength=6)
    assert calls[0]["group_list"].dtype == torch.int64
    assert calls[0]["group_list"].cpu().tolist() == counts.cumsum(0).tolist()
    assert len(npu.called("npu_swiglu")) == (1 if act_fn is F.silu else 0)
    twins = reference_twins(hidden, gate_up, down)
    ref = ref_moe.eager(twins[0], index, weights, twins[1], twins[2], act_fn)
    assert_same(out, ref, (hidden, gate_up, down), twins)


def test_segment_ends_are_read_to_the_host_once_per_tensor(npu):
    module = adapter("npu_fusion_attention")
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=npu.device)
    first = module.host_bounds(cu)
    assert module.host_bounds(cu) is first  # every layer of a micro-batch reuses the first read
    cu[1] = 4  # modified in place: read again
    assert module.host_bounds(cu) == [0, 4, 8]


@pytest.mark.parametrize("name, call", [
    ("npu_fusion_attention", lambda m, t: m.attention(t, t, t, cu_seqlens_q=torch.tensor([0, 2]),
                                                      cu_seqlens_k=torch.tensor([0, 2]), max_seqlen_q=2,
                                                      max_seqlen_k=2, scale=1.0)),
    ("npu_rms_norm", lambda m, t: m.rms_norm(t, t[0, 0], 1e-6)),
    ("npu_swiglu", lambda m, t: m.swiglu_mlp(t[0], t[0], t[0], t[0])),
])
def test_float64_is_refused_with_the_fallback_named(npu, name, call):
    t = torch.zeros(2, 2, 2, dtype=torch.float64, device=npu.device)
    with pytest.raises(TypeError, match=rf"{name} computes in float16, bfloat16 or float32, got torch.float64; use the reference"):
        call(adapter(name), t)
    assert npu.calls == []
