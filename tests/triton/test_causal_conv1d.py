"""causal_conv1d against one F.conv1d per sequence (float64): outputs and gradients of x, weight, bias."""

import pytest
import torch
from patchgen.kernels.triton import causal_conv1d
from patchgen.kernels.triton.causal_conv1d import causal_conv1d_reference
from triton_helpers import grads, max_err

TOL = 1e-12


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_varlen_forward_and_gradients(device, width, activation):
    # sequences shorter than the kernel, and a D that is not a power of two, are included
    cu = torch.tensor([0, 1, 3, 70, 100], dtype=torch.int32, device=device)
    x = torch.randn(1, 100, 40, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(40, width, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(40, dtype=torch.float64, device=device, requires_grad=True)
    y = causal_conv1d(x, w, b, activation=activation, cu_seqlens=cu)
    y_ref = causal_conv1d_reference(x, w, b, activation=activation, cu_seqlens=cu.cpu())
    assert max_err(y, y_ref) < TOL
    dy = torch.randn_like(y)
    for a, r in zip(grads([y], [x, w, b], [dy]), grads([y_ref], [x, w, b], [dy])):
        assert max_err(a, r) < TOL


def test_sequences_do_not_leak_into_each_other(device):
    x = torch.randn(1, 20, 16, dtype=torch.float64, device=device)
    w = torch.randn(16, 4, dtype=torch.float64, device=device)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32, device=device)
    y = causal_conv1d(x, w, cu_seqlens=cu)
    alone = causal_conv1d(x[:, 8:], w)
    assert max_err(y[:, 8:], alone) < TOL


def test_batch_without_bias(device):
    x = torch.randn(2, 30, 16, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(16, 4, dtype=torch.float64, device=device, requires_grad=True)
    y = causal_conv1d(x, w)
    y_ref = causal_conv1d_reference(x, w)
    assert max_err(y, y_ref) < TOL
    dy = torch.randn_like(y)
    for a, r in zip(grads([y], [x, w], [dy]), grads([y_ref], [x, w], [dy])):
        assert max_err(a, r) < TOL


def test_bfloat16_output_dtype_and_accuracy(device):
    """bf16 in and out, fp32 accumulation: one bf16 rounding of the output (relative 4e-3)."""
    x = torch.randn(1, 50, 32, device=device)
    w = torch.randn(32, 4, device=device)
    y = causal_conv1d(x.bfloat16(), w.bfloat16())
    y_ref = causal_conv1d_reference(x.bfloat16().double(), w.bfloat16().double())
    assert y.dtype == torch.bfloat16
    assert max_err(y, y_ref) < 8e-3 * y_ref.abs().max().item()


@pytest.mark.parametrize("shift", ["scratch", "recompute"])
def test_backward_on_small_tiles_spanning_sequences_and_channel_blocks(device, shift):
    """Many row tiles and several channel blocks: the persistent backward's overlapping tiles,
    scratch shift and per-program weight sums (CUDA's), and the portable backward (other devices'),
    must both give the reference gradients."""
    from patchgen.kernels.triton.causal_conv1d import ConvTuning, conv_bwd

    cu = torch.tensor([0, 2, 9, 61, 100], dtype=torch.int32, device=device)
    x = torch.randn(1, 100, 40, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(40, 4, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(40, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn(1, 100, 40, dtype=torch.float64, device=device)
    tiny = ConvTuning(bwd_bt=8, bwd_bd=16, bwd_programs_per_sm=1, bwd_kernel=shift, recompute_bt=8, recompute_bd=16)
    dx, dw, db = conv_bwd(x[0].detach(), w.detach(), b.detach(), dy[0], cu, True, tiny)
    y_ref = causal_conv1d_reference(x, w, b, cu_seqlens=cu.cpu())
    for a, r in zip((dx, dw, db), grads([y_ref], [x, w, b], [dy])):
        assert max_err(a.reshape(r.shape), r) < TOL


def test_unknown_backward_shift_is_refused(device):
    from patchgen.kernels.triton.causal_conv1d import ConvTuning, conv_bwd

    x = torch.randn(8, 16, dtype=torch.float64, device=device)
    w = torch.randn(16, 4, dtype=torch.float64, device=device)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="bwd_kernel must be 'window', 'segment', 'scratch' or 'recompute', got 'roll'"):
        conv_bwd(x, w, None, torch.randn_like(x), cu, True, ConvTuning(bwd_kernel="roll"))


def _window(rows, chunk=8, bd=16, design="window"):
    from patchgen.kernels.triton.causal_conv1d import ConvTuning

    return ConvTuning(fwd_kernel=design, fwd_rows=rows, fwd_chunk=chunk, fwd_bd=bd, fwd_warps=1,
                      bwd_kernel=design, bwd_rows=rows, bwd_chunk=chunk, bwd_bd=bd, bwd_warps=1, bwd_stages=2)


# (width, rows a step): rows < width - 1 takes several halo steps; rows > chunk / 2, one step a chunk
@pytest.mark.parametrize("width,rows", [(4, 4), (4, 2), (3, 1), (2, 8)])
def test_window_kernels_over_chunks_sequences_and_channel_blocks(device, width, rows):
    """Chunks of 8 rows, sequences of 1 and 2 rows and ones crossing chunks, 24 channels in blocks of
    16: the row-window forward and backward against the float64 reference."""
    from patchgen.kernels.triton.causal_conv1d import conv_bwd, conv_fwd

    cu = torch.tensor([0, 1, 3, 12, 13, 22], dtype=torch.int32, device=device)
    x = torch.randn(1, 22, 24, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(24, width, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn(1, 22, 24, dtype=torch.float64, device=device)
    y_ref = causal_conv1d_reference(x, w, b, cu_seqlens=cu.cpu())
    y = conv_fwd(x[0].detach(), w.detach(), b.detach(), cu, True, _window(rows))
    assert max_err(y, y_ref[0]) < TOL
    got = conv_bwd(x[0].detach(), w.detach(), b.detach(), dy[0], cu, True, _window(rows))
    for a, r in zip(got, grads([y_ref], [x, w, b], [dy])):
        assert max_err(a.reshape(r.shape), r) < TOL


# (width, rows a step, activation): steps larger than the short sequences; several halo steps
@pytest.mark.parametrize("width,rows,activation", [(4, 4, "silu"), (3, 1, None)])
def test_segment_kernels_over_chunks_sequences_and_channel_blocks(device, width, rows, activation):
    """The segment design splits each chunk of 8 rows at sequence boundaries: sequences of 1 and 2
    rows, an empty one, ones crossing chunks, 24 channels in blocks of 16, against float64."""
    from patchgen.kernels.triton.causal_conv1d import conv_bwd, conv_fwd

    cu = torch.tensor([0, 1, 3, 3, 12, 13, 22], dtype=torch.int32, device=device)
    x = torch.randn(1, 22, 24, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(24, width, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn(1, 22, 24, dtype=torch.float64, device=device)
    # the reference takes no empty sequence; the kernels must treat it as absent
    y_ref = causal_conv1d_reference(x, w, b, activation=activation, cu_seqlens=torch.unique(cu.cpu()))
    tuning = _window(rows, design="segment")
    silu = activation is not None
    assert max_err(conv_fwd(x[0].detach(), w.detach(), b.detach(), cu, silu, tuning), y_ref[0]) < TOL
    got = conv_bwd(x[0].detach(), w.detach(), b.detach(), dy[0], cu, silu, tuning)
    for a, r in zip(got, grads([y_ref], [x, w, b], [dy])):
        assert max_err(a.reshape(r.shape), r) < TOL


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inside the inf sequence
def test_segment_kernels_do_not_read_other_sequences(device):
    """Non-finite values in one sequence leave the others' outputs and gradients finite and exact
    (a masked load, not a product with zero, keeps them out)."""
    from patchgen.kernels.triton.causal_conv1d import conv_bwd, conv_fwd

    cu = torch.tensor([0, 6, 11, 20], dtype=torch.int32, device=device)
    x = torch.randn(20, 16, dtype=torch.float64, device=device)
    x[6:11] = float("inf")
    w = torch.randn(16, 4, dtype=torch.float64, device=device)
    dy = torch.randn(20, 16, dtype=torch.float64, device=device)
    tuning = _window(4, design="segment")
    y = conv_fwd(x, w, None, cu, True, tuning)
    dx = conv_bwd(x, w, None, dy, cu, True, tuning)[0]
    for lo, hi in ((0, 6), (11, 20)):
        alone = conv_fwd(x[lo:hi].contiguous(), w, None, torch.tensor([0, hi - lo], dtype=torch.int32, device=device),
                         True, tuning)
        assert torch.isfinite(y[lo:hi]).all() and max_err(y[lo:hi], alone) < TOL
        assert torch.isfinite(dx[lo:hi]).all()


def test_window_kernels_without_bias_or_activation(device, monkeypatch):
    """Through the autograd op with the window design as the module's launch configuration."""
    import importlib

    # the package re-exports the function under the module's name: take the module itself
    monkeypatch.setattr(importlib.import_module("patchgen.kernels.triton.causal_conv1d"), "TUNING", _window(4))
    cu = torch.tensor([0, 5, 20], dtype=torch.int32, device=device)
    x = torch.randn(1, 20, 16, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(16, 4, dtype=torch.float64, device=device, requires_grad=True)
    y = causal_conv1d(x, w, activation=None, cu_seqlens=cu)
    y_ref = causal_conv1d_reference(x, w, activation=None, cu_seqlens=cu.cpu())
    assert max_err(y, y_ref) < TOL
    dy = torch.randn_like(y)
    for a, r in zip(grads([y], [x, w], [dy]), grads([y_ref], [x, w], [dy])):
        assert max_err(a, r) < TOL


@pytest.mark.parametrize("design", ["window", "segment"])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)], ids=["fp32", "bf16"])
def test_window_kernels_in_low_precision_against_float64(device, dtype, bound, design):
    """fp32 accumulation, one rounding to the input dtype: outputs and all gradients within that
    rounding of the float64 reference taken on the same (rounded) inputs."""
    from patchgen.kernels.triton.causal_conv1d import conv_bwd, conv_fwd

    cu = torch.tensor([0, 3, 21], dtype=torch.int32, device=device)
    x = torch.randn(1, 21, 16, device=device).to(dtype)
    w = torch.randn(16, 4, device=device).to(dtype)
    b = torch.randn(16, device=device).to(dtype)
    dy = torch.randn(1, 21, 16, device=device).to(dtype)
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    y_ref = causal_conv1d_reference(*ref, cu_seqlens=cu.cpu())
    y = conv_fwd(x[0], w, b, cu, True, _window(4, design=design))
    got = conv_bwd(x[0], w, b, dy[0], cu, True, _window(4, design=design))
    assert y.dtype == dtype and all(g.dtype == dtype for g in got)
    for a, r in zip([y, *got], [y_ref[0], *grads([y_ref], ref, [dy.double()])]):
        assert max_err(a.reshape(r.shape), r) < bound * r.abs().max().item()


def test_launch_presets_by_name_with_overrides():
    from patchgen.kernels.triton.causal_conv1d import PRESETS
    from patchgen.kernels.triton.launch_config import parse_config

    got = parse_config("window,bwd_rows=8,bwd_stages=None,bwd_fast=True,fwd_fast=False", PRESETS, "conv")
    assert got.bwd_kernel == "window" and got.bwd_rows == 8 and got.bwd_stages is None and got.fwd_rows == 4
    assert got.bwd_fast is True and got.fwd_fast is False


def test_unknown_launch_preset_or_field_is_refused(monkeypatch):
    from patchgen.kernels.errors import SettingError
    from patchgen.kernels.triton.causal_conv1d import PRESETS
    from patchgen.kernels.triton.launch_config import config_from_env

    monkeypatch.setenv("PATCHGEN_TRITON_CONV", "windows")
    with pytest.raises(SettingError, match=r"PATCHGEN_TRITON_CONV='windows': unknown conv preset 'windows'; known: "
                                           r"tile-scratch, window"):
        config_from_env("PATCHGEN_TRITON_CONV", PRESETS, None, "conv")
    monkeypatch.setenv("PATCHGEN_TRITON_CONV", "window,rows=8")
    with pytest.raises(SettingError, match=r"'rows=8' is not field=value with a field of ConvTuning"):
        config_from_env("PATCHGEN_TRITON_CONV", PRESETS, None, "conv")


def test_cu_seqlens_on_another_device_is_refused():
    x = torch.randn(1, 8, 16)
    w = torch.randn(16, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must be on x's device \(cpu\), got meta"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("silu", [True, False])
def test_window_fast_path_skips_masks_only_inside_sequences(device, silu):
    """Steps deep inside a 17-row sequence take the unmasked path, the others (sequence starts and
    ends, the halo, rows past the end) the masked one: both against the float64 reference."""
    from dataclasses import replace

    from patchgen.kernels.triton.causal_conv1d import conv_bwd, conv_fwd

    tuning = replace(_window(4), fwd_fast=True, bwd_fast=True)
    cu = torch.tensor([0, 1, 3, 20, 22], dtype=torch.int32, device=device)
    x = torch.randn(1, 22, 16, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(16, 4, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(16, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn(1, 22, 16, dtype=torch.float64, device=device)
    activation = "silu" if silu else None
    y_ref = causal_conv1d_reference(x, w, b, activation=activation, cu_seqlens=cu.cpu())
    assert max_err(conv_fwd(x[0].detach(), w.detach(), b.detach(), cu, silu, tuning), y_ref[0]) < TOL
    got = conv_bwd(x[0].detach(), w.detach(), b.detach(), dy[0], cu, silu, tuning)
    for a, r in zip(got, grads([y_ref], [x, w, b], [dy])):
        assert max_err(a.reshape(r.shape), r) < TOL


def test_unpacked_batch_boundaries_are_made_once_per_shape():
    from patchgen.kernels.triton.causal_conv1d import _batch_cu_seqlens

    first = _batch_cu_seqlens(3, 5, torch.device("cpu"))
    assert first.tolist() == [0, 5, 10, 15] and first.dtype == torch.int32
    assert _batch_cu_seqlens(3, 5, torch.device("cpu")) is first
    assert _batch_cu_seqlens(3, 6, torch.device("cpu")).tolist() == [0, 6, 12, 18]


@pytest.mark.parametrize("preset", ["segment", "segment-reg168", "segment-v4"])
def test_segment_presets_as_the_sweep_runs_them(device, preset):
    """The presets the sweep times (launch options included: a register cap and a vector width reach
    the launch), at a tiny width, against float64."""
    from patchgen.kernels.triton.causal_conv1d import PRESETS, _bwd_launch, conv_bwd, conv_fwd

    tuning = PRESETS[preset]
    cu = torch.tensor([0, 2, 13], dtype=torch.int32, device=device)
    x = torch.randn(1, 13, 16, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(16, 4, dtype=torch.float64, device=device, requires_grad=True)
    dy = torch.randn(1, 13, 16, dtype=torch.float64, device=device)
    meta = _bwd_launch(13, 16, 4, 2, torch.float64, torch.device(device), False, True, tuning)[3]
    assert meta.get("maxnreg") == tuning.bwd_maxnreg and meta["VEC"] == (tuning.bwd_vec or 0)
    y_ref = causal_conv1d_reference(x, w, cu_seqlens=cu.cpu())
    assert max_err(conv_fwd(x[0].detach(), w.detach(), None, cu, True, tuning), y_ref[0]) < TOL
    got = conv_bwd(x[0].detach(), w.detach(), None, dy[0], cu, True, tuning)[:2]
    for a, r in zip(got, grads([y_ref], [x, w], [dy])):
        assert max_err(a.reshape(r.shape), r) < TOL


def test_a_shape_table_first_built_in_inference_mode_serves_a_later_training_forward():
    """The kernels keep small tables per shape (`shape_cache_get`, the batch rows' boundaries among them); one first
    built during an inference-mode forward (an RL step's reference log-probs) must not be an inference tensor, which
    the training forward of the same shape would fail to save for backward."""
    from patchgen.kernels.triton._common import shape_cache_get

    cache = {}
    with torch.inference_mode():
        built = shape_cache_get(cache, (2, 8, torch.device("cpu")), lambda: torch.arange(0, 17, 8, dtype=torch.int32))
    assert not built.is_inference() and shape_cache_get(cache, (2, 8, torch.device("cpu")), None) is built
