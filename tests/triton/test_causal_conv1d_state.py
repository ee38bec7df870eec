"""causal_conv1d with an initial state per sequence against the reference conv (float64): outputs and
the gradients of x, weight, bias and the state; the shared-prefix conv on our state kernels equals packed."""

import pytest
import torch
from patchgen.kernels.reference.causal_conv1d import causal_conv1d as reference
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_causal_conv1d
from patchgen.kernels.triton import causal_conv1d
from triton_helpers import grads, max_err

TOL = 1e-12


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_initial_state_forward_and_gradients(device, width, activation):
    # one-row and two-row sequences (shorter than the look-back), more sequences than a program's
    # block of states, and a D that is not a power of two
    lengths = [1, 2, 37, 3, 1, 1, 5, 1, 2, 1, 1, 1, 4, 1, 1, 1, 1, 2, 6]
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    t, n = sum(lengths), len(lengths)
    x = torch.randn(1, t, 40, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(40, width, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(40, dtype=torch.float64, device=device, requires_grad=True)
    state = torch.randn(n, width - 1, 40, dtype=torch.float64, device=device, requires_grad=True)
    y = causal_conv1d(x, w, b, activation=activation, cu_seqlens=cu, initial_state=state)
    y_ref = reference(x, w, b, activation=activation, cu_seqlens=cu, initial_state=state)
    assert max_err(y, y_ref) < TOL
    dy = torch.randn_like(y)
    for a, r in zip(grads([y], [x, w, b, state], [dy]), grads([y_ref], [x, w, b, state], [dy])):
        assert max_err(a, r) < TOL


def test_initial_state_of_the_wrong_shape_is_refused(device):
    cu = torch.tensor([0, 2, 9], dtype=torch.int32, device=device)
    x, w = torch.randn(1, 9, 8, device=device), torch.randn(8, 4, device=device)
    with pytest.raises(ValueError, match=r"initial_state must be \[sequences, W-1, D\] = \[2, 3, 8\]"):
        causal_conv1d(x, w, cu_seqlens=cu, initial_state=torch.zeros(2, 4, 8, device=device))


def test_shared_prefix_conv_on_our_state_kernels_equals_packed(device):
    # a 3-level tree with one-row leaves and a 2-row prefix under which a child starts 2 rows in
    g = torch.Generator().manual_seed(1)
    root, mid = torch.randint(1, 999, (70,), generator=g).tolist(), torch.randint(1, 999, (65,), generator=g).tolist()
    seqs = [root + [5], root + mid + [6], root + mid + [7, 8], [3, 4, 9, 9], [3, 4, 1]]
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    plan = build_plan(ids.to(device), cu.to(device), max_depth=4, level_cost=0, min_prefix=2)
    assert plan.depth == 2 and causal_conv1d.look_back is not None
    x = torch.randn(1, plan.compact_length, 24, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(24, 4, dtype=torch.float64, device=device, requires_grad=True)
    b = torch.randn(24, dtype=torch.float64, device=device, requires_grad=True)
    y = plan.expand(shared_prefix_causal_conv1d(plan, causal_conv1d, x, w, b, activation="silu"))
    y_ref = reference(plan.expand(x), w, b, activation="silu", cu_seqlens=cu.to(device))
    assert max_err(y, y_ref) < 1e-10
    dy = torch.randn_like(y)
    for a, r in zip(grads([y], [x, w, b], [dy]), grads([y_ref], [x, w, b], [dy])):
        assert max_err(a, r) < 1e-10


def test_shared_prefix_conv_on_our_state_kernels_reads_a_strided_weight_and_bias(device):
    """The slot's weight and bias may be views (a column of a larger tensor): the kernels index them
    densely, so the look-back path must read them as the public conv does, element by element."""
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 3, 7, 7]]
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    plan = build_plan(ids.to(device), cu.to(device), min_prefix=2)
    x = torch.randn(1, plan.compact_length, 6, dtype=torch.float64, device=device, requires_grad=True)
    w_full = torch.randn(6, 8, dtype=torch.float64, device=device, requires_grad=True)
    b_full = torch.randn(6, 2, dtype=torch.float64, device=device, requires_grad=True)
    w, b = w_full[:, ::2], b_full[:, 0]  # strided views: weight [6, 4], bias [6]
    assert not w.is_contiguous() and not b.is_contiguous()
    y = plan.expand(shared_prefix_causal_conv1d(plan, causal_conv1d, x, w, b, activation="silu"))
    y_ref = reference(plan.expand(x), w, b, activation="silu", cu_seqlens=cu.to(device))
    assert max_err(y, y_ref) < TOL
    dy = torch.randn_like(y)
    for a, r in zip(grads([y], [x, w_full, b_full], [dy]), grads([y_ref], [x, w_full, b_full], [dy])):
        assert max_err(a, r) < TOL


@pytest.mark.parametrize("width,activation,bias", [(2, None, False), (3, "silu", False), (4, None, True)])
def test_shared_prefix_conv_on_our_state_kernels_narrower_convs_and_no_activation(device, width, activation, bias):
    """A plan built for W=4 serving narrower convs (the look-back's last W-1 slots), without the
    activation or the bias; a 1-row shared prefix (every state slot but one reads zero) and 20
    sequences under one root (more than a program's block of states)."""
    g = torch.Generator().manual_seed(3)
    root = torch.randint(1, 999, (70,), generator=g).tolist()
    seqs = [[7] + torch.randint(1, 999, (3,), generator=g).tolist() for _ in range(20)]
    seqs += [root + [5], root + [6, 6], [3, 4, 9], [3, 4]]
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    plan = build_plan(ids.to(device), cu.to(device), min_prefix=1)
    assert 1 in [n.end - n.start for n in plan.nodes]
    x = torch.randn(1, plan.compact_length, 5, dtype=torch.float64, device=device, requires_grad=True)
    params = [x, torch.randn(5, width, dtype=torch.float64, device=device, requires_grad=True)]
    if bias:
        params.append(torch.randn(5, dtype=torch.float64, device=device, requires_grad=True))
    y = plan.expand(shared_prefix_causal_conv1d(plan, causal_conv1d, *params, activation=activation))
    y_ref = reference(plan.expand(x), *params[1:], activation=activation, cu_seqlens=cu.to(device))
    assert max_err(y, y_ref) < TOL
    dy = torch.randn_like(y)
    for a, r in zip(grads([y], params, [dy]), grads([y_ref], params, [dy])):
        assert max_err(a, r) < TOL
