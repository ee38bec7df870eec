"""eager and sdpa attention against a dense float64 reference over the whole packed row."""

import pytest
import torch
from patchgen.kernels.reference import attention

F64 = torch.float64


def naive(q, k, v, q_bounds, k_bounds, scale, causal):
    """One dense [H, Tq, Tk] softmax; a query reads a key of its own segment, bottom-right causal."""
    Tq, H, _ = q.shape
    Tk, Hkv, _ = k.shape
    q_seg = torch.bucketize(torch.arange(Tq), torch.tensor(q_bounds[1:]), right=True)
    k_seg = torch.bucketize(torch.arange(Tk), torch.tensor(k_bounds[1:]), right=True)
    q_pos = torch.arange(Tq) - torch.tensor(q_bounds)[q_seg]
    k_pos = torch.arange(Tk) - torch.tensor(k_bounds)[k_seg]
    q_len = torch.tensor(q_bounds).diff()[q_seg]
    k_len = torch.tensor(k_bounds).diff()[q_seg]  # key count of each query's segment
    allowed = q_seg[:, None] == k_seg[None, :]
    if causal:
        allowed &= k_pos[None, :] <= (q_pos + k_len - q_len)[:, None]
    heads = torch.arange(H) // (H // Hkv)
    scores = torch.einsum("qhd,khd->hqk", q, k[:, heads]) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v[:, heads])


CASES = {
    "same_lengths": ([0, 3, 10, 16], [0, 3, 10, 16]),
    "q_shorter_than_k": ([0, 2, 5, 6], [0, 4, 12, 20]),
    # rows of one length (a batch of unpacked rows): sdpa takes one batched call
    "equal_rows": ([0, 5, 10, 15], [0, 5, 10, 15]),
}


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_matches_dense_reference_with_gqa(backend, case, causal):
    q_bounds, k_bounds = CASES[case]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(q_bounds[-1], 4, 8, dtype=F64, generator=gen, requires_grad=True)
    k, v = (torch.randn(k_bounds[-1], 2, 8, dtype=F64, generator=gen, requires_grad=True) for _ in range(2))
    fn = getattr(attention, backend)
    out = fn(
        q,
        k,
        v,
        cu_seqlens_q=torch.tensor(q_bounds, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(k_bounds, dtype=torch.int32),
        max_seqlen_q=max(torch.tensor(q_bounds).diff()),
        max_seqlen_k=max(torch.tensor(k_bounds).diff()),
        scale=0.25,
        causal=causal,
    )
    ref = naive(q, k, v, q_bounds, k_bounds, 0.25, causal)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))
    ):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_single_query_reads_every_key_of_its_segment():
    q = torch.zeros(1, 1, 2, dtype=F64)
    k = torch.zeros(3, 1, 2, dtype=F64)
    v = torch.tensor([[[3.0, 0.0]], [[0.0, 3.0]], [[3.0, 3.0]]], dtype=F64)
    one, three = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    out = attention.eager(
        q, k, v, cu_seqlens_q=one, cu_seqlens_k=three, max_seqlen_q=1, max_seqlen_k=3, scale=1.0, causal=True
    )
    assert out.flatten().tolist() == [2.0, 2.0]


def test_sdpa_runs_rows_of_one_length_in_one_call(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    q, k, v = (torch.randn(12, 2, 4, dtype=F64) for _ in range(3))
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    attention.sdpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4, scale=0.5)
    assert len(calls) == 1 and calls[0]["is_causal"]
    calls.clear()
    uneven = torch.tensor([0, 4, 12], dtype=torch.int32)
    attention.sdpa(q, k, v, cu_seqlens_q=uneven, cu_seqlens_k=uneven, max_seqlen_q=8, max_seqlen_k=8, scale=0.5)
    assert len(calls) == 2  # per segment, with the bottom-right mask
