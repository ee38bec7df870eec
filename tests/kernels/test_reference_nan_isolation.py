"""A NaN in one packed sequence never reaches another sequence of the row.

Masking by multiplying with 0 keeps NaN (NaN * 0 = NaN); the references select instead. (Within one
sequence a NaN may reach earlier tokens through a zero-weighted product, as in the fused kernels.)
"""

import pytest
import torch
from patchgen.kernels.reference import attention as ref_attention
from patchgen.kernels.reference import gated_delta_rule as ref_gdn
from patchgen.kernels.reference.causal_conv1d import causal_conv1d

CU = torch.tensor([0, 5, 12], dtype=torch.int32)


def poisoned(x, position=4):
    """x with a NaN at ``position`` (the last token of the first sequence) in every channel."""
    x = x.clone()
    x[:, position] = float("nan")
    return x


def test_conv_nan_in_one_sequence_stays_in_it():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 12, 6, generator=gen), torch.randn(6, 4, generator=gen)
    out = causal_conv1d(poisoned(x), w, cu_seqlens=CU)
    assert torch.isfinite(out[:, 5:]).all()
    assert torch.equal(out[:, 5:], causal_conv1d(x[:, 5:], w))


@pytest.mark.parametrize("position", [2, 4])
def test_gdn_nan_in_one_sequence_stays_in_it(position):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 12, 1, 8, generator=gen) for _ in range(2))
    v = torch.randn(1, 12, 2, 8, generator=gen)
    g, beta = -torch.rand(1, 12, 2, generator=gen), torch.rand(1, 12, 2, generator=gen)
    o, _ = ref_gdn.gated_delta_rule(poisoned(q, position), poisoned(k, position), poisoned(v, position), g, beta, cu_seqlens=CU)
    assert torch.isfinite(o[:, 5:]).all()
    alone, _ = ref_gdn.gated_delta_rule(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:])
    torch.testing.assert_close(o[:, 5:], alone, rtol=0, atol=1e-6)


def test_gdn_rows_of_a_batch_are_separate_sequences():
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 9, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 9, 2, 8, generator=gen, dtype=torch.float64)
    g = -torch.rand(2, 9, 2, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, 9, 2, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, 2, 8, 8, generator=gen, dtype=torch.float64)
    both, final = ref_gdn.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for row in range(2):
        alone, alone_final = ref_gdn.gated_delta_rule(
            *(x[row : row + 1] for x in (q, k, v, g, beta)), initial_state=h0[row : row + 1], output_final_state=True
        )
        torch.testing.assert_close(both[row : row + 1], alone, rtol=0, atol=1e-12)
        torch.testing.assert_close(final[row : row + 1], alone_final, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_attention_nan_in_one_sequence_stays_in_it(backend):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 8, generator=gen) for _ in range(3))
    fn = getattr(ref_attention, backend)
    kwargs = dict(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=7, max_seqlen_k=7, scale=0.3)
    out = fn(poisoned(q.unsqueeze(0)).squeeze(0), poisoned(k.unsqueeze(0)).squeeze(0), poisoned(v.unsqueeze(0)).squeeze(0), **kwargs)
    assert torch.isfinite(out[5:]).all()
