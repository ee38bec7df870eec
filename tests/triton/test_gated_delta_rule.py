"""The public gated_delta_rule against the token-by-token float64 reference: outputs, final
state and the gradients of every input, with a final-state gradient flowing in."""

import pytest
import torch
from patchgen.kernels.triton import gated_delta_rule
from patchgen.kernels.triton.gated_delta_rule.reference import recurrent_gdn_ref
from patchgen.kernels.triton.gated_delta_rule.varlen import chunk_indices_from_lengths
from triton_helpers import gdn_inputs, grads, max_err

TOL = 1e-10  # relative to the largest reference value (at least 1): float64 rounding only


def close(a, b, tol=TOL) -> bool:
    return max_err(a, b) < tol * max(1.0, b.abs().max().item())


def reference(x, *, scale=None, l2norm=True, with_final=True):
    """The token-by-token float64 recurrence on x's inputs: (o [1, T, HV, V], final state)."""
    K = x["q"].shape[-1]
    o_ref, final_ref = recurrent_gdn_ref(*(x[n][0] for n in ("q", "k", "v", "g", "beta")),
                                         scale=K ** -0.5 if scale is None else scale,
                                         initial_state=x["h0"], output_final_state=with_final,
                                         use_qk_l2norm=l2norm, cu_seqlens=x["cu"].cpu())
    return o_ref[None], final_ref


def run_both(x, *, scale=None, l2norm=True, with_final=True, **kw):
    names = ("q", "k", "v", "g", "beta")
    o, final = gated_delta_rule(*(x[n] for n in names), scale=scale, initial_state=x["h0"],
                                output_final_state=with_final, use_qk_l2norm_in_kernel=l2norm,
                                cu_seqlens=x["cu"], **kw)
    return (o, final), reference(x, scale=scale, l2norm=l2norm, with_final=with_final)


def check_all(x, got, want):
    (o, final), (o_ref, final_ref) = got, want
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    assert close(o, o_ref)
    if final_ref is not None:
        assert final.shape == final_ref.shape
        assert close(final, final_ref)
    cot = [torch.randn_like(o), None if final is None else torch.randn_like(final)]
    inputs = [x[n] for n in ("q", "k", "v", "g", "beta", "h0")]
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads([o, final], inputs, cot),
                          grads([o_ref, final_ref], inputs, cot)):
        if b is not None:
            assert close(a, b), name


@pytest.mark.parametrize("l2norm", [True, False])
def test_varlen_with_initial_state_forward_and_all_gradients(device, l2norm):
    x = gdn_inputs([70, 5, 130], device=device)
    check_all(x, *run_both(x, l2norm=l2norm))


def test_the_transposing_backward_gives_every_gradient(device, monkeypatch):
    # tl.trans for the transposed tiles of the WY and output backwards
    import importlib

    transposes = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.transposes")
    monkeypatch.setattr(transposes, "TUNING", transposes.PRESETS["trans"])
    x = gdn_inputs([70, 5], device=device)  # a partial chunk, a sequence shorter than one, initial states
    check_all(x, *run_both(x))


def test_without_initial_state_and_final_state(device):
    x = gdn_inputs([100, 29], device=device, with_state=False)
    (o, final), want = run_both(x, with_final=False)
    assert final is None
    check_all(x, (o, final), want)


def test_equal_key_and_value_heads_and_explicit_scale(device):
    x = gdn_inputs([64, 65], H=2, HV=2, K=32, V=16, device=device)
    check_all(x, *run_both(x, scale=0.7))


def test_batched_rows_without_cu_seqlens(device):
    x = gdn_inputs([50, 50], device=device)
    names = ("q", "k", "v", "g", "beta")
    batched = [t.view(2, 50, *t.shape[2:]) for t in (x[n] for n in names)]
    o, final = gated_delta_rule(*batched, initial_state=x["h0"], output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    o_ref, final_ref = gated_delta_rule(*(x[n] for n in names), initial_state=x["h0"], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    assert max_err(o.reshape(o_ref.shape), o_ref) < TOL
    assert max_err(final, final_ref) < TOL


def test_precomputed_chunk_tables_give_identical_results(device):
    lengths = [70, 5, 130]
    x = gdn_inputs(lengths, device=device)
    names = ("q", "k", "v", "g", "beta")
    args = [x[n].detach() for n in names]
    base, _ = gated_delta_rule(*args, initial_state=x["h0"].detach(), cu_seqlens=x["cu"])
    with_cpu, _ = gated_delta_rule(*args, initial_state=x["h0"].detach(), cu_seqlens=x["cu"],
                                   cu_seqlens_cpu=x["cu"].cpu())
    with_idx, _ = gated_delta_rule(*args, initial_state=x["h0"].detach(), cu_seqlens=x["cu"],
                                   chunk_indices=chunk_indices_from_lengths(lengths).to(device))
    assert torch.equal(base, with_cpu) and torch.equal(base, with_idx)


def test_shared_prefix_two_round_split_equals_packed(device):
    """Round A runs prefix[0:64) and exports its state; round B runs the tail prefix[64:84) once and
    tail + suffix_i per member, all from that state. Outputs and every gradient equal the packed run."""
    P, B, suffixes = 84, 64, [30, 50]
    full = gdn_inputs([P, *suffixes], device=device, with_state=False)  # leaves: [prefix | suf1 | suf2]
    names = ("q", "k", "v", "g", "beta")
    leaves = [full[n] for n in names]

    def pieces(t):
        t = t[0]
        return t[:P], t[P:P + suffixes[0]], t[P + suffixes[0]:]

    def row(parts):
        return torch.cat(parts)[None]

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    # packed: [prefix + suf1 | prefix + suf2]
    packed = [row([p, s1, p, s2]) for p, s1, s2 in map(pieces, leaves)]
    o_packed, f_packed = gated_delta_rule(*packed, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=cu([P + suffixes[0], P + suffixes[1]]))

    # round A: prefix[0:B) from zero; round B: [tail | tail + suf1 | tail + suf2] from S_B
    round_a = [row([p[:B]]) for p, _, _ in map(pieces, leaves)]
    o_a, s_b = gated_delta_rule(*round_a, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu([B]))
    round_b = [row([p[B:], p[B:], s1, p[B:], s2]) for p, s1, s2 in map(pieces, leaves)]
    tail = P - B
    o_b, f_b = gated_delta_rule(*round_b, initial_state=s_b.index_select(0, torch.zeros(3, dtype=torch.long,
                                                                                         device=device)),
                                output_final_state=True, use_qk_l2norm_in_kernel=True,
                                cu_seqlens=cu([tail, tail + suffixes[0], tail + suffixes[1]]))
    prefix_out = torch.cat([o_a[0], o_b[0, :tail]])
    s1_start = tail + tail
    s2_start = s1_start + suffixes[0] + tail
    expanded = torch.cat([prefix_out, o_b[0, s1_start:s1_start + suffixes[0]], prefix_out,
                          o_b[0, s2_start:s2_start + suffixes[1]]])[None]

    assert max_err(expanded, o_packed) < TOL
    assert max_err(f_b[1:], f_packed) < TOL
    do, dft = torch.randn_like(o_packed), torch.randn_like(f_packed)
    for a, b in zip(grads([expanded, f_b[1:]], leaves, [do, dft]), grads([o_packed, f_packed], leaves, [do, dft])):
        assert max_err(a, b) < TOL


def fp32_against_float64(x64):
    """Run our kernels in fp32 on a copy of the float64 inputs `x64`; check outputs and every gradient
    against the token-by-token float64 recurrence (not our own kernels run in float64), all finite."""
    x32 = {n: (t.detach().float().requires_grad_() if t is not None and t.is_floating_point() else t)
           for n, t in x64.items()}
    names = ("q", "k", "v", "g", "beta")
    o, f = gated_delta_rule(*(x32[n] for n in names), initial_state=x32["h0"], output_final_state=True,
                            use_qk_l2norm_in_kernel=True, cu_seqlens=x32["cu"])
    o_ref, f_ref = reference(x64)
    assert o.dtype == torch.float32 and f.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(f).all()
    assert max_err(o, o_ref) < 1e-4 and max_err(f, f_ref) < 1e-4
    do, dft = torch.randn_like(o_ref), torch.randn_like(f_ref)
    ins32 = [x32[n] for n in (*names, "h0")]
    ins64 = [x64[n] for n in (*names, "h0")]
    for a, b in zip(grads([o, f], ins32, [do.float(), dft.float()]), grads([o_ref, f_ref], ins64, [do, dft])):
        assert torch.isfinite(a).all()
        assert max_err(a, b) < 1e-4 * max(1.0, b.abs().max().item())


def test_float32_close_to_float64_reference(device):
    """fp32 inputs with fp32 state and accumulation: a few chunks of fp32 rounding (unit roundoff
    6e-8, amplified by the triangular solve and the state recurrence) stay below 1e-4 absolute on O(1)
    outputs and gradients."""
    fp32_against_float64(gdn_inputs([70, 5, 130], device=device))


def test_strong_decays_stay_finite_in_a_partial_last_chunk(device):
    """Real checkpoints decay by several nats a token (g = -exp(A_log) * softplus(a + dt_bias)), so a
    chunk's cumulative log-decay reaches -300 and beyond. Rows past a sequence's end must not enter
    any exp with it (exp(+300) overflows float32 and inf * 0 is NaN): outputs and every gradient stay
    finite and match the float64 recurrence, forward and backward, with lengths that end mid-chunk."""
    x64 = gdn_inputs([70, 5, 120], device=device)  # 120: a last chunk of 56 real rows, 8 past the end
    with torch.no_grad():
        x64["g"].mul_(20.0)  # about -10 nats a token
    fp32_against_float64(x64)


def test_bfloat16_inputs_keep_fp32_state(device):
    """bf16 inputs (unit roundoff 4e-3 on every stored intermediate): outputs within 5e-2 of the float64
    run on O(1) values; the final state is fp32."""
    x = gdn_inputs([70, 40], device=device)
    names = ("q", "k", "v", "g", "beta")
    bf = [x[n].detach().to(torch.bfloat16) for n in names]
    o, f = gated_delta_rule(*bf, initial_state=x["h0"].detach().float(), output_final_state=True,
                            use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    o_ref, f_ref = reference(x)  # the float64 recurrence
    assert o.dtype == torch.bfloat16 and f.dtype == torch.float32
    assert max_err(o, o_ref) < 5e-2 * max(1.0, o_ref.abs().max().item())
    assert max_err(f, f_ref) < 5e-2 * max(1.0, f_ref.abs().max().item())


def test_value_heads_must_be_a_multiple_of_key_heads(device):
    x = gdn_inputs([10], H=3, HV=4, device=device)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta")), cu_seqlens=x["cu"])


def test_half_dqk_design_feeds_the_l2norm_backward_bf16_and_stays_accurate(device, monkeypatch):
    """Preset `trans-half`: with bf16 inputs the per-value-head dq, dk reach the l2norm backward in bf16
    (half the bytes); every gradient stays within bf16 rounding of the float64 reference."""
    import importlib

    transposes = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.transposes")
    autograd = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.autograd")
    monkeypatch.setattr(transposes, "TUNING", transposes.PRESETS["trans-half"])
    seen = []
    real = autograd.l2norm_bwd
    monkeypatch.setattr(autograd, "l2norm_bwd", lambda y, r, dy, dtype: seen.append(dy.dtype) or real(y, r, dy, dtype))
    x = gdn_inputs([70, 5], device=device)
    names = ("q", "k", "v", "g", "beta")
    bf = [x[n].detach().to(torch.bfloat16).requires_grad_() for n in names]
    o, _ = gated_delta_rule(*bf, initial_state=x["h0"].detach().float(), output_final_state=True,
                            use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    ref_in = [t.detach().double().requires_grad_() for t in bf]
    o_ref, _ = recurrent_gdn_ref(*(t[0] for t in ref_in), scale=x["q"].shape[-1] ** -0.5,
                                     initial_state=x["h0"].detach(), output_final_state=True, use_qk_l2norm=True,
                                     cu_seqlens=x["cu"].cpu())
    do = torch.randn_like(o_ref)
    got = torch.autograd.grad(o[0], bf, do.to(torch.bfloat16))
    want = torch.autograd.grad(o_ref, ref_in, do.to(torch.bfloat16).double())
    assert seen == [torch.bfloat16, torch.bfloat16]
    for name, a, b in zip(names, got, want):
        assert max_err(a, b) < 5e-2 * max(1.0, b.abs().max().item()), name
