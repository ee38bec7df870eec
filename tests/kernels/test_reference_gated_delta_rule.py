"""The torch GDN backend against a token-by-token float64 recurrence, and against upstream."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels.reference.gated_delta_rule import gated_delta_rule

F64 = torch.float64


def naive(q, k, v, g, beta, scale, h0, bounds, l2norm):
    """S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T (scale q), per sequence, in float64."""
    _, _T, H, _K = q.shape
    HV, _V = v.shape[-2:]
    group = HV // H
    outputs, finals = [], []
    for n, (start, end) in enumerate(itertools.pairwise(bounds)):
        state = h0[n].clone()
        for t in range(start, end):
            qt, kt = q[0, t].repeat_interleave(group, 0), k[0, t].repeat_interleave(group, 0)
            if l2norm:
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
            state = state * g[0, t].exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", state, kt)
            delta = beta[0, t][:, None] * (v[0, t] - predicted)
            state = state + torch.einsum("hk,hv->hkv", kt, delta)
            outputs.append(torch.einsum("hkv,hk->hv", state, qt * scale))
        finals.append(state)
    return torch.stack(outputs).unsqueeze(0), torch.stack(finals)


def inputs(T, H, HV, K, V, N, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen, dtype=dtype)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen, dtype=dtype)) * 0.5
    beta = torch.rand(1, T, HV, generator=gen, dtype=dtype)
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=dtype) * 0.1
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


# Sequences that cross chunk boundaries, start mid-chunk, and have one token.
BOUNDS = [0, 5, 75, 150, 151]


@pytest.mark.parametrize("l2norm", [True, False])
def test_forward_and_gradients_match_the_recurrence_across_sequence_boundaries(l2norm):
    q, k, v, g, beta, h0 = inputs(T=151, H=2, HV=4, K=8, V=6, N=4)
    if not l2norm:  # keep the unnormalised recurrence stable
        with torch.no_grad():
            k /= k.norm(dim=-1, keepdim=True)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    o, final = gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=0.3,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm,
        cu_seqlens=cu,
    )
    o_ref, final_ref = naive(q, k, v, g, beta, 0.3, h0, BOUNDS, l2norm)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)

    weights = torch.randn_like(o), torch.randn_like(final)
    ours = torch.autograd.grad((o * weights[0]).sum() + (final * weights[1]).sum(), (q, k, v, g, beta, h0))
    ref = torch.autograd.grad(
        (o_ref * weights[0]).sum() + (final_ref * weights[1]).sum(), (q, k, v, g, beta, h0)
    )
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"gradient of {name}")


def test_initial_state_gradient_reaches_every_sequence():
    q, k, v, g, beta, h0 = inputs(T=151, H=1, HV=2, K=4, V=4, N=4)
    o, _ = gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.tensor(BOUNDS, dtype=torch.int32),
    )
    (dh0,) = torch.autograd.grad(o.sum(), h0)
    assert all(dh0[n].abs().sum() > 0 for n in range(4))


def test_packed_row_equals_separate_calls():
    q, k, v, g, beta, h0 = inputs(T=151, H=2, HV=2, K=8, V=8, N=4)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    o, final = gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )
    for n, (s, e) in enumerate(itertools.pairwise(BOUNDS)):
        part = [x[:, s:e] for x in (q, k, v, g, beta)]
        o_n, f_n = gated_delta_rule(
            *part, initial_state=h0[n : n + 1], output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(o[:, s:e], o_n, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(final[n], f_n[0], rtol=1e-12, atol=1e-12)


def test_cu_seqlens_cpu_is_used_instead_of_the_device_copy():
    q, k, v, g, beta, h0 = inputs(T=151, H=1, HV=1, K=4, V=4, N=4)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    a, _ = gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    b, _ = gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu * 0, cu_seqlens_cpu=cu)
    torch.testing.assert_close(a, b)


def test_defaults_scale_by_inverse_sqrt_k_and_return_no_state():
    q, k, v, g, beta, _ = inputs(T=20, H=1, HV=1, K=16, V=4, N=1)
    o, final = gated_delta_rule(q, k, v, g, beta)
    o_ref, _ = naive(q, k, v, g, beta, 16**-0.5, torch.zeros(1, 1, 16, 4, dtype=F64), [0, 20], False)
    assert final is None
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)


def test_matches_upstream_bit_for_bit_in_fp32():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, _ = (x.detach().float() for x in inputs(T=130, H=2, HV=4, K=16, V=8, N=1))
    h0 = torch.randn(1, 4, 16, 8)
    ours = gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    theirs = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)


def test_bf16_output_keeps_v_dtype_and_fp32_state():
    q, k, v, g, beta, h0 = (x.detach().to(torch.bfloat16) for x in inputs(T=10, H=1, HV=1, K=4, V=4, N=1))
    o, final = gated_delta_rule(q, k, v, g, beta, initial_state=h0.float(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
