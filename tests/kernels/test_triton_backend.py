"""The ``triton`` backend (patchgen.kernels.triton) through its handles, against the torch references.

Runs on CPU under TRITON_INTERPRET=1 (set by tests/conftest.py) at tiny sizes; fp32, so the
bounds are fp32 rounding bounds.
"""

import pytest
import torch
from patchgen.kernels import registry
from patchgen.kernels.reference import causal_conv1d as conv_ref
from patchgen.kernels.reference import gated_delta_rule as gdn_ref
from patchgen.kernels.reference import norms
from patchgen.kernels.selection import resolve


def triton_fn(slot):
    handle = registry.handle(slot, "triton")
    if not handle.available:
        pytest.skip(f"triton backend unavailable: {handle.reason}")
    return handle.load()


def test_resolving_triton_on_the_npu_target_uses_our_package():
    triton_fn("gated_delta_rule")
    table = resolve(None, device_target="npu")
    import patchgen.kernels.triton as ours

    assert table.handle("gated_delta_rule").load() is ours.gated_delta_rule
    assert table.handle("causal_conv1d").load() is ours.causal_conv1d
    assert table.handle("rms_norm_gated").load() is ours.rms_norm_gated


def test_gated_delta_rule_forward_and_backward_with_cu_seqlens_and_initial_state():
    fn = triton_fn("gated_delta_rule")
    gen = torch.Generator().manual_seed(0)
    T, H, HV, K, V = 20, 1, 2, 16, 16
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen)
    g = -torch.rand(1, T, HV, generator=gen) * 0.3
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = torch.randn(2, HV, K, V, generator=gen)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    results = []
    for impl in (fn, gdn_ref.gated_delta_rule):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, final = impl(
            *leaves[:5],
            initial_state=leaves[5],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
        )
        grads = torch.autograd.grad((o * o).sum() + final.sum(), leaves)
        results.append((o, final, grads))
    (o, final, grads), (o_ref, final_ref, grads_ref) = results
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-4)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=f"gradient of {name}")


def test_causal_conv1d_respects_sequence_starts():
    fn = triton_fn("causal_conv1d")
    x, w, b = torch.randn(1, 12, 8), torch.randn(8, 4), torch.randn(8)
    cu = torch.tensor([0, 2, 12], dtype=torch.int32)
    torch.testing.assert_close(
        fn(x, w, b, cu_seqlens=cu), conv_ref.causal_conv1d(x, w, b, cu_seqlens=cu), rtol=1e-5, atol=1e-5
    )


def test_rms_norm_gated_forward():
    fn = triton_fn("rms_norm_gated")
    x, gate, w = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16)
    torch.testing.assert_close(
        fn(x, gate, w, 1e-6), norms.rms_norm_gated(x, gate, w, 1e-6), rtol=1e-5, atol=1e-5
    )
