"""eager and grouped_mm experts against a per-token float64 sum, and eager against upstream."""

import torch
import torch.nn.functional as F
from patchgen.kernels.reference import moe_experts

F64 = torch.float64


def naive(hidden, index, weights, gate_up, down):
    rows = []
    for t in range(hidden.shape[0]):
        total = hidden.new_zeros(hidden.shape[1])
        for slot in range(index.shape[1]):
            e = index[t, slot]
            gate, up = (gate_up[e] @ hidden[t]).chunk(2)
            total = total + weights[t, slot] * (down[e] @ (F.silu(gate) * up))
        rows.append(total)
    return torch.stack(rows)


def data(dtype, seed=3):
    gen = torch.Generator().manual_seed(seed)
    E, N, d, inter, top_k = 5, 9, 8, 4, 2
    hidden = torch.randn(N, d, dtype=dtype, generator=gen, requires_grad=True)
    gate_up = torch.randn(E, 2 * inter, d, dtype=dtype, generator=gen, requires_grad=True)
    down = torch.randn(E, d, inter, dtype=dtype, generator=gen, requires_grad=True)
    index = torch.stack([torch.randperm(E - 1, generator=gen)[:top_k] for _ in range(N)])  # expert 4 unused
    weights = torch.rand(N, top_k, dtype=dtype, generator=gen, requires_grad=True)
    return hidden, index, weights, gate_up, down


def check(fn, dtype, rtol, atol):
    hidden, index, weights, gate_up, down = data(dtype)
    out = fn(hidden, index, weights, gate_up, down, F.silu)
    h64, w64, gu64, d64 = (x.detach().double().requires_grad_() for x in (hidden, weights, gate_up, down))
    ref = naive(h64, index, w64, gu64, d64)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    g = torch.randn_like(ref)
    ours = torch.autograd.grad((out * g.to(dtype)).sum(), (hidden, weights, gate_up, down))
    theirs = torch.autograd.grad((ref * g).sum(), (h64, w64, gu64, d64))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol)


def test_eager_in_float64():
    check(moe_experts.eager, F64, 1e-12, 1e-12)


def test_batched_mm_in_float64():
    check(moe_experts.batched_mm, F64, 1e-12, 1e-12)


def test_grouped_mm_in_float32():
    check(moe_experts.grouped_mm, torch.float32, 1e-5, 1e-4)


def test_eager_equals_upstream_experts():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    config = type(
        "C",
        (),
        {
            "num_experts": 5,
            "hidden_size": 8,
            "moe_intermediate_size": 4,
            "hidden_act": "silu",
            "_experts_implementation": "eager",
        },
    )()
    module = Qwen3_5MoeExperts(config)
    hidden, index, weights, gate_up, down = (
        x.detach() if x.is_floating_point() else x for x in data(torch.float32)
    )
    module.gate_up_proj.data.copy_(gate_up)
    module.down_proj.data.copy_(down)
    ours = moe_experts.eager(hidden, index, weights, gate_up, down, module.act_fn)
    torch.testing.assert_close(ours, module(hidden, index, weights), rtol=1e-6, atol=1e-6)
