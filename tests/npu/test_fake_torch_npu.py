"""The fake torch_npu keeps to the documented semantics: what it computes, and what it refuses."""

import pytest
import torch
from patchgen.kernels.reference import attention as ref_attention

from tests.npu import fake_torch_npu as fake
from tests.npu.fake_torch_npu import FakeNpuRejected

MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def qkv(tq=6, tk=10, heads=2, kv_heads=1, dim=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(tq, heads, dim, generator=gen, dtype=dtype), torch.randn(tk, kv_heads, dim, generator=gen, dtype=dtype),
            torch.randn(tk, kv_heads, dim, generator=gen, dtype=dtype))


def attend(q, k, v, **overrides):
    arguments = dict(atten_mask=MASK, scale=0.3, actual_seq_qlen=[2, q.shape[0]], actual_seq_kvlen=[4, k.shape[0]],
                     sparse_mode=3)
    arguments.update(overrides)
    return fake.npu_fusion_attention(q, k, v, q.shape[1], "TND", **arguments)


def test_sparse_mode_3_aligns_each_segment_bottom_right():
    q, k, v = qkv()
    out = attend(q, k, v)
    assert len(out) == 7
    bounds = dict(cu_seqlens_q=torch.tensor([0, 2, 6]), cu_seqlens_k=torch.tensor([0, 4, 10]), max_seqlen_q=4,
                  max_seqlen_k=6, scale=0.3)
    assert torch.allclose(out[0], ref_attention.eager(q, k, v, **bounds), atol=1e-6)


def test_sparse_mode_2_aligns_top_left_so_shorter_queries_differ():
    q, k, v = qkv()
    assert not torch.allclose(attend(q, k, v)[0], attend(q, k, v, sparse_mode=2)[0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(actual_seq_qlen=torch.tensor([2, 6])), "list of Python ints"),
        (dict(actual_seq_qlen=[0, 2, 6]), "must have one length"),
        (dict(actual_seq_kvlen=[4, 9]), "must end at the row length 10"),
        (dict(atten_mask=None), "2048x2048 upper-triangular"),
        (dict(atten_mask=MASK[:1024, :1024]), "2048x2048 upper-triangular"),
        (dict(scale=1), "scale is a float"),
        (dict(sparse_mode=5), "varlen does not support sparse_mode 5"),
        (dict(actual_seq_qlen=[6] * 1025, actual_seq_kvlen=[10] * 1025), "holds 1..1024 entries"),
    ],
)
def test_fusion_attention_refuses_what_the_operator_documents_as_invalid(overrides, message):
    with pytest.raises(FakeNpuRejected, match=message):
        attend(*qkv(), **overrides)


def test_fusion_attention_refuses_float64_and_heads_that_do_not_group():
    with pytest.raises(FakeNpuRejected, match="float16, bfloat16 or float32"):
        attend(*qkv(dtype=torch.float64))
    with pytest.raises(FakeNpuRejected, match="multiple of key heads"):
        attend(*qkv(heads=3, kv_heads=2))


def test_rms_norm_returns_the_output_and_the_fp32_reciprocal_rms():
    x, gamma = torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0])
    y, rstd = fake.npu_rms_norm(x, gamma, epsilon=0.0)
    expected_rstd = 1 / (12.5**0.5)
    assert torch.allclose(rstd, torch.tensor([[expected_rstd]]))
    assert torch.allclose(y, x * expected_rstd * gamma)
    with pytest.raises(FakeNpuRejected, match="one dtype"):
        fake.npu_rms_norm(x, gamma.double())


def test_rotary_mul_half_mode_rotates_the_two_halves():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    zeros, ones = torch.zeros(1, 1, 1, 4), torch.ones(1, 1, 1, 4)
    assert fake.npu_rotary_mul(x, zeros, ones).flatten().tolist() == [-3.0, -4.0, 1.0, 2.0]
    with pytest.raises(FakeNpuRejected, match="fits no documented layout"):
        fake.npu_rotary_mul(torch.zeros(2, 3, 5, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))


def test_swiglu_activates_the_first_half_and_wants_contiguous_input():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert torch.allclose(fake.npu_swiglu(x), torch.nn.functional.silu(x[:, :2]) * x[:, 2:])
    with pytest.raises(FakeNpuRejected, match="contiguous"):
        fake.npu_swiglu(torch.zeros(4, 2).T)


def test_grouped_matmul_groups_rows_by_cumulative_ends():
    x, w = torch.randn(5, 3), torch.randn(2, 3, 4)
    (y,) = fake.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 5]), group_type=0, split_item=3)
    assert torch.allclose(y, torch.cat((x[:2] @ w[0], x[2:] @ w[1])))
    with pytest.raises(FakeNpuRejected, match="must equal x's rows"):
        fake.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 4]), group_type=0, split_item=3)
    with pytest.raises(FakeNpuRejected, match="must not be transposed"):
        fake.npu_grouped_matmul([torch.randn(3, 5).T], [w], group_list=torch.tensor([2, 5]), group_type=0, split_item=3)
