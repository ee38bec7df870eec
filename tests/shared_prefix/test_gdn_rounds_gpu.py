"""The one-node GDN path on the GPU at Qwen3.5-4B widths, bf16: its forward is the per-round loop's,
bit for bit, on fla and on our Triton kernels (same kernels on the same rows), and its gradients
are the loop's up to the order of summing replayed rows. Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_gated_delta_rule

from tests.models.prefix_trees import pack
from tests.shared_prefix.test_tree import agentic

pytestmark = pytest.mark.gpu


def _backends():
    from patchgen.kernels.triton import gated_delta_rule as ours

    found = [pytest.param(ours, id="triton")]
    try:
        from patchgen.kernels.backends.fla import gated_delta_rule as fla
    except ImportError:
        return found
    return [*found, pytest.param(fla, id="fla")]


@pytest.mark.parametrize("gdn", _backends())
def test_one_node_forward_is_the_loops_bit_for_bit(gdn):
    ids, cu = pack(agentic(prompt=1000, turns=(130,), last=96, fan=3))  # unaligned ends: tails replayed
    plan = build_plan(ids.cuda(), cu.cuda(), max_depth=4, level_cost=0)
    assert plan.depth == 2
    torch.manual_seed(0)
    c = plan.compact_length
    q, k = (torch.randn(1, c, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, c, 32, 128, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, c, 32, device="cuda"))
    beta = torch.rand(1, c, 32, device="cuda", dtype=torch.bfloat16)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]

    def loop(*args, **kwargs):  # the public function alone: no stages
        return gdn(*args, **kwargs)

    assert getattr(gdn, "rounds", None) is not None
    weight = torch.randn(1, c, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for fn in (gdn, loop):
        out = shared_prefix_gated_delta_rule(plan, fn, *inputs, use_qk_l2norm_in_kernel=True)
        runs.append((out, torch.autograd.grad((out.float() * weight).sum(), inputs)))
    (fused, fused_grads), (looped, looped_grads) = runs
    assert torch.equal(fused, looped)
    for a, b in zip(fused_grads, looped_grads):
        scale = b.float().abs().max().clamp_min(1e-6)
        assert ((a.float() - b.float()).abs().max() / scale).item() < 1e-2
