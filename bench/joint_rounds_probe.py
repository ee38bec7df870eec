"""Which of fla's GDN stages gives the joint rounds a gradient the per-round stages do not (H200, bf16).

    python bench/joint_rounds_probe.py [--repeats 2]

`tests/shared_prefix/test_gdn_rounds_gpu.py` finds fla's joint rounds (`fla_rounds.FlaJointRounds`) one rounding
off its per-round stages in the v and gate gradients at three rounds (agentic tree: prompt 1000, a turn of 130, 3
leaves of 96), though every stage they run once for all rounds computes a chunk from its own rows. This runs both
whole paths `--repeats` times each (a path that disagrees with itself is not deterministic), then the joint
backward stage by stage on that plan, driven by the test's own upstream gradient, and per round: each state-free
stage again on the round's rows alone with its own tables, the state stages again on copies of the round's rows,
and fla's composed per-round backward (`chunk_gated_delta_rule_bwd`) against the same stages composed here; each
comparison says whether the two agree bit for bit, and by how much when not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# the tests' tree builders, after the staged package (the checkout's patchgen/ has no kernels/ on the GPU machine)
sys.path.append(str(Path(__file__).resolve().parents[1]))


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "equal"
    d = (a.float() - b.float()).abs()
    return f"DIFFER max {d.max().item():.3g} at {int((d > 0).sum())} of {d.numel()} elements"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("joint_rounds_probe.py needs a CUDA device: fla's state kernels do not run under Triton's interpreter")
    from patchgen.kernels.backends import fla as fla_backend
    from patchgen.kernels.shared_prefix import build_plan, shared_prefix_gated_delta_rule

    from tests.models.prefix_trees import pack
    from tests.shared_prefix.test_tree import agentic

    torch.use_deterministic_algorithms(True)
    ids, cu = pack(agentic(prompt=1000, turns=(130,), last=96, fan=3))
    plan = build_plan(ids.cuda(), cu.cuda(), max_depth=4, level_cost=0)
    idx = plan.gdn
    c = plan.compact_length
    torch.manual_seed(0)
    q, k = (torch.randn(1, c, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, c, 32, 128, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(1, c, 32, device="cuda"))
    beta = torch.rand(1, c, 32, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1, c, 32, 128, device="cuda", dtype=torch.bfloat16)
    print(f"plan: {len(idx.present)} rounds, rows {[r.rows for r, _ in idx.present]}, compact {c}", flush=True)

    # whole paths, each run `repeats` times: deterministic each, and joint against per-round
    grads = {}
    for name, stages in (("per-round", fla_backend._Rounds()), ("joint", fla_backend._JointRounds())):
        def gdn(*a, **kw):
            raise AssertionError("stages only")

        gdn.rounds = stages
        for r in range(args.repeats):
            inputs = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
            out = shared_prefix_gated_delta_rule(plan, gdn, *inputs, use_qk_l2norm_in_kernel=True)
            grads[(name, r)] = (out, *torch.autograd.grad((out.float() * weight).sum(), inputs))
    labels = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    for r in range(1, args.repeats):
        for name in ("per-round", "joint"):
            print(f"{name} run {r} vs run 0: " + ", ".join(
                f"{lab} {_diff(a, b)}" for lab, a, b in zip(labels, grads[(name, r)], grads[(name, 0)])))
    print("joint vs per-round: " + ", ".join(
        f"{lab} {_diff(a, b)}" for lab, a, b in zip(labels, grads[("joint", 0)], grads[("per-round", 0)])), flush=True)

    # the joint backward stage by stage; each state-free stage again per round on the round's own rows and tables
    rounds = fla_backend._JointRounds()
    st = rounds.stages
    qs, ks, vs, gs, bs = (x.index_select(1, idx.src).contiguous() for x in (q, k, v, g, beta))
    qs, _ = rounds.l2norm_fwd(qs)
    ks, _ = rounds.l2norm_fwd(ks)
    scale = 128 ** -0.5
    from patchgen.kernels.shared_prefix.gdn_rounds import final_state_grad, initial_state

    def h0_of(rnd, states):
        return initial_state(rnd, states, vs, ks.shape[3])

    with torch.no_grad():
        o, initial, saved, _ = rounds.forward_rounds(qs, ks, vs, gs, bs, scale, idx, h0_of)
        # the test's own upstream gradient: its loss is sum(out * weight), so the compact row's gradient is `weight`,
        # and the rounds' rows get it where they are kept (replayed tail rows get zero), as GDNRounds.backward does
        do = weight if idx.out_identity else torch.zeros_like(o).index_copy_(1, idx.out_index, weight)
        g_cum, A = saved
        joint = {"cu_seqlens": idx.joint.cu_seqlens, "chunk_indices": idx.joint.chunk_indices}
        w, u = st.recompute_w_u(k=ks, v=vs, beta=bs, A=A, g=g_cum, **joint)
        dv_local = st.bwd_dv_local(q=qs, k=ks, g=g_cum, do=do, scale=scale, chunk_size=64, **joint)
        present, dht, parts = idx.present, None, [None] * len(idx.present)
        dht_in = [None] * len(present)  # the dht each round's backward got
        for i in range(len(present) - 1, -1, -1):
            rnd, rows = present[i]
            own = {"cu_seqlens": rnd.cu_seqlens, "chunk_indices": rnd.chunk_indices}
            h, v_new, _ = st.fwd_h(k=ks[:, rows], w=w[:, rows], u=u[:, rows], g=g_cum[:, rows], initial_state=initial[i],
                                   output_final_state=False, chunk_size=64, chunk_offsets=rnd.chunk_offsets, **own)
            dh, dh0, dv = st.bwd_dhu(q=qs[:, rows], k=ks[:, rows], w=w[:, rows], g=g_cum[:, rows], h0=initial[i], dht=dht,
                                     do=do[:, rows], dv=dv_local[:, rows], scale=scale, chunk_size=64,
                                     chunk_offsets=rnd.chunk_offsets, **own)
            dq, dk, dw, dg = st.bwd_dqkwg(q=qs[:, rows], k=ks[:, rows], v=v_new, w=w[:, rows], g=g_cum[:, rows], h=h,
                                          dv=dv, do=do[:, rows], dh=dh, scale=scale, chunk_size=64, **own)
            parts[i] = (dq, dk, dw, dg, dv)
            dht_in[i] = dht
            # the same state stages on copies of the round's rows (own storage, offset 0), as the per-round path has
            cl = {name: t[:, rows].clone() for name, t in (("q", qs), ("k", ks), ("w", w), ("u", u), ("g", g_cum),
                                                           ("do", do), ("dvl", dv_local))}
            h_c, v_new_c, _ = st.fwd_h(k=cl["k"], w=cl["w"], u=cl["u"], g=cl["g"], initial_state=initial[i],
                                       output_final_state=False, chunk_size=64, chunk_offsets=rnd.chunk_offsets, **own)
            dh_c, dh0_c, dv_c = st.bwd_dhu(q=cl["q"], k=cl["k"], w=cl["w"], g=cl["g"], h0=initial[i], dht=dht,
                                           do=cl["do"], dv=cl["dvl"], scale=scale, chunk_size=64,
                                           chunk_offsets=rnd.chunk_offsets, **own)
            dq_c, dk_c, dw_c, dg_c = st.bwd_dqkwg(q=cl["q"], k=cl["k"], v=v_new_c, w=cl["w"], g=cl["g"], h=h_c, dv=dv_c,
                                                  do=cl["do"], dh=dh_c, scale=scale, chunk_size=64, **own)
            found = {"h": (h, h_c), "v_new": (v_new, v_new_c), "dh": (dh, dh_c), "dv (dhu)": (dv, dv_c),
                     "dq": (dq, dq_c), "dk": (dk, dk_c), "dw": (dw, dw_c), "dg": (dg, dg_c)}
            if dh0 is not None:
                found["dh0"] = (dh0, dh0_c)
            print(f"round {i}, state stages on slices of the joint rows vs on copies: " + ", ".join(
                f"{name} {_diff(a, b)}" for name, (a, b) in found.items()), flush=True)
            dht = None if i == 0 or rnd.state_index is None or dh0 is None or initial[i] is None else \
                final_state_grad(rnd, present[i - 1][0], dh0)
        dq, dk, dw, dg, du = (torch.cat(list(p), dim=1) for p in zip(*parts))
        dk2, dv_all, db, dg2 = st.wy_bwd(k=ks, v=vs, beta=bs, A=A, dw=dw, du=du, g=g_cum, **joint)
        print(f"dtypes: dv_local {dv_local.dtype}, du {du.dtype}, wy dv {dv_all.dtype}, A {A.dtype}, w {w.dtype}")
        for i, (rnd, rows) in enumerate(present):
            own = {"cu_seqlens": rnd.cu_seqlens, "chunk_indices": rnd.chunk_indices}
            sl = (slice(None), rows)
            gc_r = st.chunk_local_cumsum(gs[sl], chunk_size=64, scale=st.gate_scale, **own)
            w_r, u_r, A_r = st.fwd_intra(k=ks[sl], v=vs[sl], g=gc_r, beta=bs[sl], chunk_size=64, **own)
            w2_r, u2_r = st.recompute_w_u(k=ks[sl], v=vs[sl], beta=bs[sl], A=A[sl], g=g_cum[sl], **own)
            dvl_r = st.bwd_dv_local(q=qs[sl], k=ks[sl], g=g_cum[sl], do=do[sl], scale=scale, chunk_size=64, **own)
            dk2_r, dv_r, db_r, dg2_r = st.wy_bwd(k=ks[sl], v=vs[sl], beta=bs[sl], A=A[sl], dw=dw[sl].contiguous(),
                                                 du=du[sl].contiguous(), g=g_cum[sl], **own)
            checks = {
                "g cumsum": (g_cum[sl], gc_r), "A": (A[sl], A_r), "w (fwd_intra)": (w[sl], w_r), "u (fwd_intra)": (u[sl], u_r),
                "w (recompute)": (w[sl], w2_r), "u (recompute)": (u[sl], u2_r), "dv_local": (dv_local[sl], dvl_r),
                "wy dk": (dk2[sl], dk2_r), "wy dv": (dv_all[sl], dv_r), "wy dbeta": (db[sl], db_r), "wy dg": (dg2[sl], dg2_r),
            }
            print(f"round {i} ({rnd.rows} rows, {rnd.num_sequences} sequences), joint stage vs the round's own call:")
            for name, (a, b) in checks.items():
                print(f"    {name:<15} {_diff(a, b)}")
            # fla's composed backward of this round (the per-round path) against the stages composed here
            dq_f, dk_f, dv_f, dg_f, db_f, _ = fla_backend._Rounds().backward(
                qs[sl], ks[sl], vs[sl], gs[sl], bs[sl], scale, initial[i], (g_cum[sl], A[sl]), do[sl], dht_in[i], rnd)
            dq_s, dk_s = parts[i][0] + 0, parts[i][1] + dk2_r
            dg_s = st.chunk_local_cumsum(parts[i][3] + dg2_r, chunk_size=64, reverse=True, **own)
            print("    fla's composed backward vs these stages: " + ", ".join(f"{n} {_diff(a, b)}" for n, a, b in (
                ("dq", dq_f, dq_s), ("dk", dk_f, dk_s), ("dv", dv_f, dv_r.to(vs.dtype)), ("dg", dg_f, dg_s.to(gs.dtype)),
                ("dbeta", db_f, db_r.to(bs.dtype)))), flush=True)


if __name__ == "__main__":
    main()
