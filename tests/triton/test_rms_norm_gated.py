"""rms_norm_gated against the PyTorch formula (float64): outputs and gradients of x, gate, weight."""

import torch
from patchgen.kernels.triton import rms_norm_gated
from patchgen.kernels.triton.rms_norm_gated import rms_norm_gated_reference
from triton_helpers import grads, max_err


def test_forward_and_gradients(device):
    x = torch.randn(3, 7, 40, dtype=torch.float64, device=device, requires_grad=True)  # D not a power of two
    gate = torch.randn_like(x, requires_grad=True)
    w = torch.randn(40, dtype=torch.float64, device=device, requires_grad=True)
    y = rms_norm_gated(x, gate, w, 1e-6)
    y_ref = rms_norm_gated_reference(x, gate, w, 1e-6)
    assert max_err(y, y_ref) < 1e-12
    dy = torch.randn_like(y)
    for a, r in zip(grads([y], [x, gate, w], [dy]), grads([y_ref], [x, gate, w], [dy])):
        assert max_err(a, r) < 1e-12


def test_eps_is_honoured(device):
    x = torch.full((2, 16), 1e-3, dtype=torch.float64, device=device)
    gate = torch.ones_like(x)
    w = torch.ones(16, dtype=torch.float64, device=device)
    for eps in (1e-6, 1e-5):
        assert max_err(rms_norm_gated(x, gate, w, eps), rms_norm_gated_reference(x, gate, w, eps)) < 1e-12


def test_bfloat16_statistics_in_fp32(device):
    """bf16 in and out: one bf16 rounding of the output (relative 4e-3)."""
    x = torch.randn(64, 128, device=device).bfloat16()
    gate = torch.randn(64, 128, device=device).bfloat16()
    w = torch.randn(128, device=device).bfloat16()
    y = rms_norm_gated(x, gate, w, 1e-6)
    y_ref = rms_norm_gated_reference(x.double(), gate.double(), w.double(), 1e-6)
    assert y.dtype == torch.bfloat16
    assert max_err(y, y_ref) < 8e-3 * y_ref.abs().max().item()


def test_backward_sums_the_weight_gradient_over_many_programs(device):
    from patchgen.kernels.triton.rms_norm_gated import NormTuning, norm_bwd, norm_fwd

    x = torch.randn(37, 40, dtype=torch.float64, device=device, requires_grad=True)
    gate = torch.randn_like(x, requires_grad=True)
    w = torch.randn(40, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    _, rstd = norm_fwd(x.detach(), gate.detach(), w.detach(), 1e-6)
    got = norm_bwd(x.detach(), gate.detach(), w.detach(), rstd, dy, NormTuning(bwd_elements=128))  # 2 rows a block
    want = grads([rms_norm_gated_reference(x, gate, w, 1e-6)], [x, gate, w], [dy])
    for a, r in zip(got, want):
        assert max_err(a, r) < 1e-12


def test_pipelined_backward_loop_gives_the_same_gradients(device):
    from patchgen.kernels.triton.rms_norm_gated import PRESETS, norm_bwd, norm_fwd

    x = torch.randn(37, 40, dtype=torch.float64, device=device, requires_grad=True)
    gate = torch.randn_like(x, requires_grad=True)
    w = torch.randn(40, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    _, rstd = norm_fwd(x.detach(), gate.detach(), w.detach(), 1e-6)
    got = norm_bwd(x.detach(), gate.detach(), w.detach(), rstd, dy, PRESETS["bwd-pipe3"])
    want = grads([rms_norm_gated_reference(x, gate, w, 1e-6)], [x, gate, w], [dy])
    for a, r in zip(got, want):
        assert max_err(a, r) < 1e-12


def test_partial_sums_over_many_rows_and_wide_rows_in_the_outputs_dtypes(device):
    """The one launch that sums weight-gradient partials: more partial rows than one tile holds (a
    norm's), rows wider than one program (a conv's), split between a weight and a bias output."""
    from patchgen.kernels.triton._common import sum_partials

    tall = torch.randn(300, 40, dtype=torch.float32, device=device)
    out = torch.empty(40, dtype=torch.bfloat16, device=device)
    sum_partials(tall, out)
    want = tall.double().sum(0)
    assert out.dtype == torch.bfloat16
    # one bf16 rounding of an fp32 sum: half an ulp compiled, up to one ulp under the interpreter (it truncates)
    assert max_err(out, want) < 2 ** -7 * want.abs().max().item()
    wide = torch.randn(3, 4100 + 20, dtype=torch.float64, device=device)
    weight_grad = torch.empty(1025, 4, dtype=torch.float64, device=device)
    bias_grad = torch.empty(20, dtype=torch.float64, device=device)
    sum_partials(wide, weight_grad, bias_grad)
    assert max_err(weight_grad.flatten(), wide[:, :4100].sum(0)) < 1e-12
    assert max_err(bias_grad, wide[:, 4100:].sum(0)) < 1e-12
