"""rms_norm, rms_norm_gated, rotary and swiglu_mlp: equal to upstream modules, and right in float64."""

import pytest
import torch
from patchgen.kernels.reference.norms import rms_norm, rms_norm_gated
from patchgen.kernels.reference.rotary import rotary
from patchgen.kernels.reference.swiglu_mlp import swiglu_mlp
from transformers.models.qwen3_5 import modeling_qwen3_5 as upstream

F64 = torch.float64


def grads_match(ours, ref, leaves):
    w = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad((ours * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_equals_upstream_module(dtype):
    module = upstream.Qwen3_5RMSNorm(16, eps=1e-6)
    torch.nn.init.normal_(module.weight)
    x = torch.randn(3, 5, 16, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, module.weight, 1e-6), module(x), rtol=0, atol=0)


def test_rms_norm_float64_and_gradients():
    x = torch.randn(4, 8, dtype=F64, requires_grad=True)
    w = torch.randn(8, dtype=F64, requires_grad=True)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * (1 + w)
    out = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads_match(out, ref, (x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_gated_equals_upstream_module(dtype):
    module = upstream.Qwen3_5RMSNormGated(16, eps=1e-6).to(dtype)
    torch.nn.init.normal_(module.weight)
    x, gate = torch.randn(6, 16, dtype=dtype), torch.randn(6, 16, dtype=dtype)
    torch.testing.assert_close(rms_norm_gated(x, gate, module.weight, 1e-6), module(x, gate), rtol=0, atol=0)


def test_rms_norm_gated_float64_and_gradients():
    x, gate = (torch.randn(4, 8, dtype=F64, requires_grad=True) for _ in range(2))
    w = torch.randn(8, dtype=F64, requires_grad=True)
    ref = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * gate * torch.sigmoid(gate)
    out = rms_norm_gated(x, gate, w, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads_match(out, ref, (x, gate, w))


def cos_sin(B, T, R, dtype):
    freqs = torch.arange(T, dtype=dtype)[:, None] * (
        10000.0 ** (-torch.arange(R // 2, dtype=dtype) / (R // 2))
    )
    angles = torch.cat((freqs, freqs), -1).expand(B, T, R)
    return angles.cos(), angles.sin()


def test_partial_rotary_equals_upstream():
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16)
    cos, sin = cos_sin(2, 7, 4, torch.float32)
    ours = rotary(q, k, cos, sin)
    theirs = upstream.apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_partial_rotary_float64_rotates_pairs_and_keeps_the_rest():
    q = torch.randn(1, 2, 5, 8, dtype=F64, requires_grad=True)
    k = torch.randn(1, 1, 5, 8, dtype=F64, requires_grad=True)
    cos, sin = cos_sin(1, 5, 4, F64)

    def by_pairs(x):  # dims i and i + R/2 rotate together by the angle of i
        a, b, rest = x[..., :2], x[..., 2:4], x[..., 4:]
        c, s = cos[:, None, :, :2], sin[:, None, :, :2]
        return torch.cat((a * c - b * s, b * c + a * s, rest), -1)

    q_out, k_out = rotary(q, k, cos, sin)
    torch.testing.assert_close(q_out, by_pairs(q), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_out, by_pairs(k), rtol=1e-12, atol=1e-12)
    grads_match(q_out, by_pairs(q), (q,))


def test_swiglu_mlp_equals_upstream_module():
    config = type("C", (), {"hidden_size": 8, "hidden_act": "silu"})()
    module = upstream.Qwen3_5MLP(config, intermediate_size=12)
    x = torch.randn(3, 8)
    out = swiglu_mlp(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)
    torch.testing.assert_close(out, module(x), rtol=0, atol=0)


def test_swiglu_mlp_float64_and_gradients():
    x = torch.randn(3, 8, dtype=F64, requires_grad=True)
    gw, uw = (torch.randn(12, 8, dtype=F64, requires_grad=True) for _ in range(2))
    dw = torch.randn(8, 12, dtype=F64, requires_grad=True)
    gate = x @ gw.T
    ref = (gate * torch.sigmoid(gate) * (x @ uw.T)) @ dw.T
    out = swiglu_mlp(x, gw, uw, dw)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads_match(out, ref, (x, gw, uw, dw))
