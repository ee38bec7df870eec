"""The torch causal_conv1d backend: per-sequence zero history, against a float64 conv per sequence."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels.reference.causal_conv1d import causal_conv1d

BOUNDS = [0, 1, 3, 10, 17]


def naive(x, weight, bias, bounds):
    """Each sequence convolved alone with left zero padding, then SiLU."""
    D, W = weight.shape
    pieces = []
    for s, e in itertools.pairwise(bounds):
        seq = x[0, s:e].T.unsqueeze(0)
        y = F.conv1d(F.pad(seq, (W - 1, 0)), weight.unsqueeze(1), bias, groups=D)
        pieces.append(F.silu(y[0].T))
    return torch.cat(pieces).unsqueeze(0)


@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_and_gradients_match_per_sequence_conv(with_bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 17, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True) if with_bias else None
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    y = causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=cu)
    y_ref = naive(x, weight, bias, BOUNDS)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    leaves = [t for t in (x, weight, bias) if t is not None]
    w = torch.randn_like(y)
    for a, b in zip(
        torch.autograd.grad((y * w).sum(), leaves), torch.autograd.grad((y_ref * w).sum(), leaves)
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_no_history_leaks_across_a_sequence_start():
    x = torch.zeros(1, 8, 1, dtype=torch.float64)
    x[0, :4] = 1.0  # first sequence all ones, second all zeros
    y = causal_conv1d(
        x,
        torch.ones(1, 4, dtype=torch.float64),
        activation=None,
        cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32),
    )
    assert y[0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]


def test_without_cu_seqlens_each_batch_row_is_a_sequence():
    x = torch.randn(2, 9, 3, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    y = causal_conv1d(x, w, activation=None)
    for b in range(2):
        torch.testing.assert_close(y[b : b + 1], causal_conv1d(x[b : b + 1], w, activation=None))


def test_matches_upstream_fallback_on_a_single_sequence():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, w, b = torch.randn(1, 12, 5), torch.randn(5, 4), torch.randn(5)
    upstream = causal_conv1d_fn(x.transpose(1, 2), w, b, activation="silu").transpose(1, 2)
    torch.testing.assert_close(causal_conv1d(x, w, b), upstream, rtol=1e-6, atol=1e-6)


def test_bf16_in_bf16_out():
    y = causal_conv1d(torch.randn(1, 5, 4, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
