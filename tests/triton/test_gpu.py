"""Qwen3.5-4B widths on a CUDA device (16 key heads, 32 value heads, head dims 128), compiled Triton,
against a float32 reference. Skipped without CUDA."""

import pytest
import torch
from patchgen.kernels.triton import causal_conv1d, gated_delta_rule, rms_norm_gated
from patchgen.kernels.triton.causal_conv1d import causal_conv1d_reference
from patchgen.kernels.triton.gated_delta_rule.reference import chunked_gdn_ref
from patchgen.kernels.triton.rms_norm_gated import rms_norm_gated_reference
from triton_helpers import gdn_inputs, grads

pytestmark = pytest.mark.gpu

# Error bounds, relative to the largest reference value. fp32: fp32 state and accumulation, the
# intra-chunk triangular inverse in tf32x3 (fp32-accurate) and the other products in "ieee" fp32.
# bf16: every stored intermediate (w, u, v_new, h, dh) and the matrix-product operands are bf16
# (unit roundoff 2^-8), as in flash-linear-attention; errors compound over the chunk recurrence.
# Measured on an H200 with Triton 3.6.0, fp32: at most 1.4e-6 over o, the final state and every gradient.
BOUNDS = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 5e-2)}  # (forward, gradients)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gdn_qwen35_widths_against_float32_reference(dtype):
    x = gdn_inputs([300, 37, 687], H=16, HV=32, K=128, V=128, dtype=torch.float32, device="cuda")
    names = ("q", "k", "v", "g", "beta")
    ins = [x[n].detach().to(dtype).requires_grad_() for n in names]
    h0 = x["h0"].detach().clone().requires_grad_()
    o, f = gated_delta_rule(*ins, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                            cu_seqlens=x["cu"])
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    h0_ref = h0.detach().clone().requires_grad_()
    o_ref, f_ref = chunked_gdn_ref(*(t[0] for t in ref_ins), scale=128 ** -0.5, initial_state=h0_ref,
                                   use_qk_l2norm=True, cu_seqlens=x["cu"].cpu())
    fwd_bound, grad_bound = BOUNDS[dtype]
    assert o.dtype == dtype and f.dtype == torch.float32
    errors = {"o": rel_err(o[0], o_ref), "final_state": rel_err(f, f_ref)}
    do, dft = torch.randn_like(o_ref), torch.randn_like(f_ref)
    got = grads([o[0], f], [*ins, h0], [do.to(dtype), dft])
    want = grads([o_ref, f_ref], [*ref_ins, h0_ref], [do, dft])
    errors.update({f"d{name}": rel_err(a, b) for name, a, b in zip((*names, "h0"), got, want)})
    print(dtype, {name: f"{err:.1e}" for name, err in errors.items()})
    assert errors["o"] < fwd_bound and errors["final_state"] < fwd_bound, errors
    assert all(err < grad_bound for name, err in errors.items() if name.startswith("d")), errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_and_gated_norm_against_float32_reference(dtype):
    """One rounding of the output to the input dtype: 1e-5 (fp32), 8e-3 (bf16) relative."""
    bound = 1e-5 if dtype == torch.float32 else 8e-3
    cu = torch.tensor([0, 300, 337, 1024], dtype=torch.int32, device="cuda")
    x = torch.randn(1, 1024, 8192, device="cuda").to(dtype)
    w = torch.randn(8192, 4, device="cuda").to(dtype)
    y = causal_conv1d(x, w, cu_seqlens=cu)
    assert rel_err(y, causal_conv1d_reference(x.float(), w.float(), cu_seqlens=cu.cpu())) < bound
    x = torch.randn(1024 * 32, 128, device="cuda").to(dtype)
    gate = torch.randn_like(x)
    weight = torch.randn(128, device="cuda").to(dtype)
    y = rms_norm_gated(x, gate, weight, 1e-6)
    assert rel_err(y, rms_norm_gated_reference(x.float(), gate.float(), weight.float(), 1e-6)) < bound
