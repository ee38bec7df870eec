"""Compiled Triton on a CUDA device at Qwen3.5 widths, against float64 references. Skipped without CUDA.

Qwen3.5-4B and -9B have the same linear-attention widths (16 key heads, 32 value heads, head dims
128, conv width 4 over 2*16*128 + 32*128 = 8192 channels); the gated norm is also checked at the
27B's 48 value heads (the GDN's head counts are compile-time constants: another width costs a
full set of compiles). Every case is one packed row of sequences of uneven lengths (one shorter than a chunk), with
an initial state per sequence and its gradient for the GDN.
"""

import pytest
import torch
from patchgen.kernels.triton import causal_conv1d, gated_delta_rule, rms_norm_gated
from patchgen.kernels.triton.causal_conv1d import causal_conv1d_reference
from patchgen.kernels.triton.gated_delta_rule.reference import chunked_gdn_ref
from patchgen.kernels.triton.rms_norm_gated import rms_norm_gated_reference
from triton_helpers import gdn_inputs, grads

pytestmark = pytest.mark.gpu

# Error bounds, max |error| relative to the largest reference value. fp32: fp32 state and
# accumulation, the intra-chunk triangular inverse in tf32x3 (fp32-accurate) and the other products
# in "ieee" fp32 (measured on an H200: at most 1.4e-6). bf16: every stored intermediate (w, u, v_new,
# h, dh) and the matrix-product operands are bf16 (unit roundoff 2^-8), as in flash-linear-attention;
# errors compound over the chunk recurrence.
GDN_BOUNDS = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 5e-2)}  # (forward, gradients)
# conv and norm: a handful of fp32 operations per element, then one rounding to the input dtype
# (bf16: 2^-8 relative to the element, below 8e-3 of the largest); gradients the same.
ELEMENTWISE_BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
LENGTHS = [300, 37, 687]


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


@DTYPES
@pytest.mark.parametrize("transposes", ["loaded", "trans", "trans-half"])
def test_gdn_varlen_with_initial_state_against_float64_reference(dtype, transposes, monkeypatch, value_heads=32):
    # both designs of the backward's transposed tiles (the tuning table picks one per GPU model)
    import importlib

    module = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.transposes")
    monkeypatch.setattr(module, "TUNING", module.PRESETS[transposes])
    x = gdn_inputs(LENGTHS, H=16, HV=value_heads, K=128, V=128, dtype=torch.float64, device="cuda")
    names = ("q", "k", "v", "g", "beta")
    ins = [x[n].detach().to(dtype).requires_grad_() for n in names]
    h0 = x["h0"].detach().float().requires_grad_()
    o, f = gated_delta_rule(*ins, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                            cu_seqlens=x["cu"])
    ref_ins = [t.detach().double().requires_grad_() for t in ins]
    h0_ref = h0.detach().double().requires_grad_()
    o_ref, f_ref = chunked_gdn_ref(*(t[0] for t in ref_ins), scale=128 ** -0.5, initial_state=h0_ref,
                                   use_qk_l2norm=True, cu_seqlens=x["cu"].cpu())
    assert o.dtype == dtype and f.dtype == torch.float32
    errors = {"o": rel_err(o[0], o_ref), "final_state": rel_err(f, f_ref)}
    do, dft = torch.randn_like(o_ref), torch.randn_like(f_ref)
    got = grads([o[0], f], [*ins, h0], [do.to(dtype), dft.float()])
    want = grads([o_ref, f_ref], [*ref_ins, h0_ref], [do.to(dtype).double(), dft.float().double()])
    errors.update({f"d{name}": rel_err(a, b) for name, a, b in zip((*names, "h0"), got, want)})
    print(dtype, value_heads, transposes, {name: f"{err:.1e}" for name, err in errors.items()})
    fwd_bound, grad_bound = GDN_BOUNDS[dtype]
    assert errors["o"] < fwd_bound and errors["final_state"] < fwd_bound, errors
    assert all(err < grad_bound for name, err in errors.items() if name.startswith("d")), errors


@DTYPES
@pytest.mark.parametrize("preset", ["tile-scratch", "window", "window-r2", "segment", "segment-reg168", "segment-v4"])
def test_conv_varlen_forward_and_gradients_against_float64_reference(dtype, preset, monkeypatch):
    import importlib

    conv = importlib.import_module("patchgen.kernels.triton.causal_conv1d")
    monkeypatch.setattr(conv, "TUNING", conv.PRESETS[preset])
    T = sum(LENGTHS)
    cu = torch.tensor([0, 300, 337, T], dtype=torch.int32, device="cuda")
    x = torch.randn(1, T, 8192, device="cuda").to(dtype).requires_grad_()
    w = torch.randn(8192, 4, device="cuda").to(dtype).requires_grad_()
    x_ref, w_ref = (t.detach().double().requires_grad_() for t in (x, w))
    y = causal_conv1d(x, w, cu_seqlens=cu)
    y_ref = causal_conv1d_reference(x_ref, w_ref, cu_seqlens=cu.cpu())
    dy = torch.randn_like(y)
    errors = {"y": rel_err(y, y_ref)}
    errors.update({name: rel_err(a, b) for name, a, b in
                   zip(("dx", "dw"), grads([y], [x, w], [dy]), grads([y_ref], [x_ref, w_ref], [dy.double()]))})
    print(dtype, preset, {name: f"{err:.1e}" for name, err in errors.items()})
    assert all(err < ELEMENTWISE_BOUNDS[dtype] for err in errors.values()), errors


@DTYPES
@pytest.mark.parametrize("value_heads", [32, 48], ids=["4B_9B", "27B"])
@pytest.mark.parametrize("preset", ["default", "bwd-pipe3"])
def test_gated_norm_forward_and_gradients_against_float64_reference(dtype, value_heads, preset, monkeypatch):
    import importlib

    norm = importlib.import_module("patchgen.kernels.triton.rms_norm_gated")
    monkeypatch.setattr(norm, "TUNING", norm.PRESETS[preset])
    x = torch.randn(sum(LENGTHS) * value_heads, 128, device="cuda").to(dtype).requires_grad_()
    gate = torch.randn_like(x).requires_grad_()
    weight = torch.randn(128, device="cuda").to(dtype).requires_grad_()
    refs = [t.detach().double().requires_grad_() for t in (x, gate, weight)]
    y = rms_norm_gated(x, gate, weight, 1e-6)
    y_ref = rms_norm_gated_reference(*refs, 1e-6)
    dy = torch.randn_like(y)
    errors = {"y": rel_err(y, y_ref)}
    errors.update({name: rel_err(a, b) for name, a, b in
                   zip(("dx", "dgate", "dweight"), grads([y], [x, gate, weight], [dy]),
                       grads([y_ref], refs, [dy.double()]))})
    print(dtype, value_heads, preset, {name: f"{err:.1e}" for name, err in errors.items()})
    assert all(err < ELEMENTWISE_BOUNDS[dtype] for err in errors.values()), errors
