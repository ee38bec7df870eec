"""Each stage kernel of the chunked gated delta rule against its PyTorch stage reference (float64).

Backward stages are checked against autograd through the forward stage references.
"""

import pytest
import torch
from patchgen.kernels.triton.gated_delta_rule import reference as ref
from patchgen.kernels.triton.gated_delta_rule.chunk_output import chunk_output_bwd, chunk_output_fwd
from patchgen.kernels.triton.gated_delta_rule.chunk_state import chunk_state_bwd, chunk_state_fwd
from patchgen.kernels.triton.gated_delta_rule.cumsum import chunk_cumsum
from patchgen.kernels.triton.gated_delta_rule.l2norm import l2norm_bwd, l2norm_fwd
from patchgen.kernels.triton.gated_delta_rule.varlen import make_chunking
from patchgen.kernels.triton.gated_delta_rule.wy import wy_bwd, wy_fwd
from triton_helpers import gdn_inputs, max_err

LENGTHS = [70, 5, 130]  # not multiples of 64; one sequence shorter than a chunk
TOL = 1e-10


@pytest.fixture
def case(device):
    x = gdn_inputs(LENGTHS, device=device)
    x = {n: (t.detach()[0] if t is not None and n not in ("cu", "h0") else t) for n, t in x.items()}
    x["h0"] = x["h0"].detach()
    x["chunking"] = make_chunking(x["cu"])
    x["q"], x["k"] = ref.l2norm_ref(x["q"]), ref.l2norm_ref(x["k"])
    x["gc"] = ref.chunk_cumsum_ref(x["g"], x["cu"].cpu())
    return x


def test_chunking_tables_restart_at_every_sequence(device):
    c = make_chunking(torch.tensor([0, 70, 75, 205], dtype=torch.int32, device=device))
    assert c.chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]]
    assert c.chunk_offsets.tolist() == [0, 2, 3, 6]
    assert (c.num_seqs, c.num_chunks) == (3, 6)


def test_l2norm_forward_and_backward(device):
    x = torch.randn(37, 3, 20, dtype=torch.float64, device=device, requires_grad=True)
    y, rstd = l2norm_fwd(x.detach())
    y_ref = ref.l2norm_ref(x)
    assert max_err(y, y_ref) < TOL
    dy = torch.randn_like(y)
    (dx_ref,) = torch.autograd.grad(y_ref, x, dy)
    assert max_err(l2norm_bwd(y, rstd, dy, x.dtype), dx_ref) < TOL


def test_l2norm_backward_sums_the_value_heads_of_each_key_head(device):
    # dq, dk come per value head (3 value heads per key head here); the backward takes them unsummed
    x = torch.randn(37, 2, 20, dtype=torch.float64, device=device, requires_grad=True)
    y, rstd = l2norm_fwd(x.detach())
    dy = torch.randn(37, 6, 20, dtype=torch.float64, device=device)
    (dx_ref,) = torch.autograd.grad(ref.l2norm_ref(x), x, dy.view(37, 2, 3, 20).sum(2))
    assert max_err(l2norm_bwd(y, rstd, dy, x.dtype), dx_ref) < TOL


def test_l2norm_backward_refuses_a_gradient_that_is_not_whole_groups(device):
    y, rstd = l2norm_fwd(torch.randn(5, 2, 8, device=device))
    with pytest.raises(ValueError, match=r"dy \(5, 3, 8\) must be y's shape \(5, 2, 8\)"):
        l2norm_bwd(y, rstd, torch.randn(5, 3, 8, device=device), y.dtype)


def test_cumsum_is_chunk_local_forward_and_reverse(case):
    gc = chunk_cumsum(case["g"], case["chunking"])
    assert max_err(gc, case["gc"]) < TOL
    dG = torch.randn_like(case["g"])
    g = case["g"].clone().requires_grad_()
    (dg_ref,) = torch.autograd.grad(ref.chunk_cumsum_ref(g, case["cu"].cpu()), g, dG)
    assert max_err(chunk_cumsum(dG, case["chunking"], reverse=True), dg_ref) < TOL


@pytest.mark.parametrize("block_v", [None, 16])
def test_wy_forward(case, block_v):
    HV = case["v"].shape[1]
    A, w, u = wy_fwd(case["k"], case["v"], case["beta"], case["gc"], case["chunking"], block_v=block_v)
    A_ref, w_ref, u_ref = ref.wy_ref(ref.expand_heads(case["k"], HV), case["v"], case["beta"], case["gc"], case["cu"])
    assert max_err(A, A_ref) < TOL
    assert max_err(w, w_ref) < TOL
    assert max_err(u, u_ref) < TOL


@pytest.mark.parametrize("trans", [False, True])
def test_wy_backward(case, trans):
    # trans: the design that takes transposed tiles with tl.trans instead of second loads and products
    HV = case["v"].shape[1]
    k_exp = ref.expand_heads(case["k"], HV).requires_grad_()
    v, beta, gc = (case[n].clone().requires_grad_() for n in ("v", "beta", "gc"))
    _, w_ref, u_ref = ref.wy_ref(k_exp, v, beta, gc, case["cu"])
    dw, du = torch.randn_like(w_ref), torch.randn_like(u_ref)
    dk_ref, dv_ref, db_ref, dG_ref = torch.autograd.grad((w_ref, u_ref), (k_exp, v, beta, gc), (dw, du))
    A, _, _ = wy_fwd(case["k"], case["v"], case["beta"], case["gc"], case["chunking"])
    dk, dv, db, dG = wy_bwd(case["k"], case["v"], case["beta"], case["gc"], A, dw, du, case["chunking"], block_v=16,
                            trans=trans)
    for got, want in ((dk, dk_ref), (dv, dv_ref), (db, db_ref), (dG, dG_ref)):
        assert max_err(got, want) < TOL


def test_chunk_state_forward(case):
    HV = case["v"].shape[1]
    _, w, u = wy_fwd(case["k"], case["v"], case["beta"], case["gc"], case["chunking"])
    h, v_new, final = chunk_state_fwd(case["k"], w, u, case["gc"], case["chunking"], initial_state=case["h0"],
                                      output_final_state=True, block_v=16)
    h_ref, vn_ref, final_ref = ref.chunk_state_ref(ref.expand_heads(case["k"], HV), w, u, case["gc"], case["cu"],
                                                   initial_state=case["h0"])
    assert max_err(h, h_ref) < TOL
    assert max_err(v_new, vn_ref) < TOL
    assert max_err(final, final_ref) < TOL


def test_chunk_output_forward(case):
    HV = case["v"].shape[1]
    _, w, u = wy_fwd(case["k"], case["v"], case["beta"], case["gc"], case["chunking"])
    h, v_new, _ = chunk_state_fwd(case["k"], w, u, case["gc"], case["chunking"], initial_state=case["h0"])
    o = chunk_output_fwd(case["q"], case["k"], case["gc"], h, v_new, 0.3, case["chunking"], block_v=16)
    o_ref = ref.chunk_output_ref(ref.expand_heads(case["q"], HV), ref.expand_heads(case["k"], HV), case["gc"], h,
                                 v_new, 0.3, case["cu"])
    assert max_err(o, o_ref) < TOL


@pytest.mark.parametrize("trans", [False, True])
def test_state_and_output_backward(case, trans):
    """chunk_state_bwd (du, dh0) and chunk_output_bwd (dq, dk, dw, dG) against autograd through
    chunk_state_ref + chunk_output_ref, with a final-state gradient flowing in; trans: the output
    backward's design that transposes the gradient of Q K^T with tl.trans."""
    HV = case["v"].shape[1]
    scale = 0.3
    _, w, u = wy_fwd(case["k"], case["v"], case["beta"], case["gc"], case["chunking"])
    leaves = [ref.expand_heads(case["q"], HV), ref.expand_heads(case["k"], HV), w, u, case["gc"], case["h0"]]
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    q_e, k_e, w_l, u_l, gc_l, h0_l = leaves
    h_ref, vn_ref, final_ref = ref.chunk_state_ref(k_e, w_l, u_l, gc_l, case["cu"], initial_state=h0_l)
    o_ref = ref.chunk_output_ref(q_e, k_e, gc_l, h_ref, vn_ref, scale, case["cu"])
    do, dht = torch.randn_like(o_ref), torch.randn_like(final_ref)
    dq_ref, dk_ref, dw_ref, du_ref, dG_ref, dh0_ref = torch.autograd.grad((o_ref, final_ref), leaves, (do, dht))

    chunking = case["chunking"]
    h, v_new, _ = chunk_state_fwd(case["k"], w, u, case["gc"], chunking, initial_state=case["h0"])
    dh, du, dh0 = chunk_state_bwd(case["q"], case["k"], w, case["gc"], do, scale, chunking, dht=dht,
                                  need_dh0=True, block_v=16)
    dq, dk, dw, dG = chunk_output_bwd(case["q"], case["k"], case["gc"], h, dh, v_new, do, du, scale, chunking,
                                      block_v=16, trans=trans)
    for got, want in ((du, du_ref), (dh0, dh0_ref), (dq, dq_ref), (dk, dk_ref), (dw, dw_ref), (dG, dG_ref)):
        assert max_err(got, want) < TOL


def test_chunked_reference_equals_recurrent_reference():
    x = gdn_inputs(LENGTHS)
    args = [x[n][0] for n in ("q", "k", "v", "g", "beta")]
    o_c, f_c = ref.chunked_gdn_ref(*args, scale=0.25, initial_state=x["h0"], use_qk_l2norm=True, cu_seqlens=x["cu"])
    o_r, f_r = ref.recurrent_gdn_ref(*args, scale=0.25, initial_state=x["h0"], output_final_state=True,
                                     use_qk_l2norm=True, cu_seqlens=x["cu"])
    assert max_err(o_c, o_r) < TOL
    assert max_err(f_c, f_r) < TOL


def test_chunk_offsets_over_more_sequences_than_one_block(device):
    """The one-launch chunk offsets, past the kernel's block of 1024 sequences, against Python sums."""
    lengths = [(7 * i) % 150 + 1 for i in range(1500)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    want = [0]
    for length in lengths:
        want.append(want[-1] + -(-length // 64))
    assert make_chunking(cu, cu_seqlens_cpu=cu.cpu()).chunk_offsets.tolist() == want


def test_per_head_dq_dk_in_a_narrower_dtype_are_the_wide_ones_rounded(case):
    """The `half_dqk` design's stages: dq from the output backward and dk from the WY backward written in
    a narrower dtype are the same sums rounded once (here float64 -> float32); the other outputs, and the
    fp32 dk the WY backward adds to, are untouched."""
    scale, chunking = 0.3, case["chunking"]
    A, w, u = wy_fwd(case["k"], case["v"], case["beta"], case["gc"], chunking)
    h, v_new, _ = chunk_state_fwd(case["k"], w, u, case["gc"], chunking, initial_state=case["h0"])
    do = torch.randn(*v_new.shape, dtype=v_new.dtype)
    dh, du, _ = chunk_state_bwd(case["q"], case["k"], w, case["gc"], do, scale, chunking, block_v=16)
    wide = chunk_output_bwd(case["q"], case["k"], case["gc"], h, dh, v_new, do, du, scale, chunking, block_v=16)
    narrow = chunk_output_bwd(case["q"], case["k"], case["gc"], h, dh, v_new, do, du, scale, chunking, block_v=16,
                              dq_dtype=torch.float32)
    assert narrow[0].dtype == torch.float32 and torch.equal(narrow[0], wide[0].to(torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(narrow[1:], wide[1:]))
    _, dk, dw, dG = wide
    dk_in = dk.clone()
    dk_narrow, *rest_narrow = wy_bwd(case["k"], case["v"], case["beta"], case["gc"], A, dw, du, chunking,
                                     dk=dk.clone(), dg=dG.clone(), block_v=16, dk_dtype=torch.float32)
    dk_wide, *rest_wide = wy_bwd(case["k"], case["v"], case["beta"], case["gc"], A, dw, du, chunking, dk=dk,
                                 dg=dG.clone(), block_v=16)
    assert dk_narrow.dtype == torch.float32 and torch.equal(dk_narrow, dk_wide.to(torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(rest_narrow, rest_wide))
    assert dk_wide is dk and not torch.equal(dk_wide, dk_in)  # the wide one is added in place
