"""P12: kernel calls per layer do not grow with n or the number of groups (GDN 2, conv 1, attention 1)."""

import pytest
import torch
from patchgen.kernels.shared_prefix import (
    build_plan,
    shared_prefix_attention,
    shared_prefix_causal_conv1d,
    shared_prefix_gated_delta_rule,
)


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 2000, (n,), generator=g).tolist()


def layer(plan, ref):
    gdn, conv, attn = (
        ref.Counting(ref.gdn_chunked),
        ref.Counting(ref.causal_conv1d),
        ref.Counting(ref.attention),
    )
    c = plan.compact_length
    with torch.no_grad():
        x = torch.randn(1, c, 4, dtype=torch.float64)
        shared_prefix_causal_conv1d(plan, conv, x, torch.randn(4, 4, dtype=torch.float64))
        q, k = torch.randn(1, c, 1, 4, dtype=torch.float64), torch.randn(1, c, 1, 4, dtype=torch.float64)
        v = torch.randn(1, c, 2, 2, dtype=torch.float64)
        g, beta = -torch.rand(1, c, 2, dtype=torch.float64), torch.rand(1, c, 2, dtype=torch.float64)
        shared_prefix_gated_delta_rule(plan, gdn, q, k, v, g, beta)
        shared_prefix_attention(plan, attn, q, k, k, scale=0.5)
    return gdn.calls, conv.calls, attn.calls


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("prompts", [1, 3])
def test_p12_kernel_calls_per_layer(ref, n, prompts):
    seqs = []
    for p in range(prompts):
        seqs += ref.grpo(tokens(70 + 30 * p, p), [tokens(1 + i % 3, 100 + i) for i in range(n)])
        seqs.append(tokens(5, 50 + p))  # a singleton between groups
    plan = build_plan(*ref.pack(seqs))
    assert len(plan.groups) == prompts and all(len(g.members) == n for g in plan.groups)
    assert layer(plan, ref) == (2, 1, 1)
