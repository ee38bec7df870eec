"""The op checks of `bench/bf16_departure.py`: one mixer op's row-invariance checks, and `--probe`.

`op_checks` runs the checks of `row_invariance.py` that pair a mixer op's packed call with the calls
the shared path makes instead (each sequence alone, the shared call, the first shared sequence cut
along its path through the prefix tree); the model run feeds it recorded inputs, `probe` random ones
at the model's widths, with every projection's `F.linear` and the norm and MLP slots, without a model.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from row_invariance import (
    Check,
    attention_alone,
    attention_rows,
    attention_shared,
    conv_alone,
    conv_shared,
    gdn_alone,
    gdn_shared,
    gdn_split,
    linear_rows,
    member_path,
    token_rows,
)
from shared_prefix_arms import MODULE, config_for
from shared_prefix_shapes import shape_batch, tree_settings

CHUNK = 64  # the GDN chunk: the shared rounds hand the state on at multiples of it


def op_checks(slot, fn, args, kwargs, plan, name: str = "") -> list[Check]:
    """Row-invariance checks of one mixer op on its packed-call inputs."""
    member = member_path(plan)
    if slot == "causal_conv1d":
        x, weight, bias = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
        act, cu = kwargs.get("activation"), kwargs["cu_seqlens"]
        return conv_alone(fn, x, weight, bias, act, cu) + [conv_shared(fn, x, weight, bias, act, cu, plan)]
    if slot == "gated_delta_rule":
        q, k, v, g, beta = args[:5]
        cu, chunks = kwargs["cu_seqlens"], kwargs.get("chunk_indices")
        checks = gdn_alone(fn, q, k, v, g, beta, cu, chunks)
        if member is not None:
            start, end, segments = member
            # the rounds hand a node's state on at its last whole chunk
            splits = sorted(
                {(o + n) // CHUNK * CHUNK for o, n, shared in segments if shared} - {0, end - start}
            )
            if splits:
                checks.append(gdn_split(fn, q, k, v, g, beta, start, end, splits))
        return checks + [gdn_shared(fn, q, k, v, g, beta, cu, plan, chunks)]
    if slot == "attention":
        q, k, v = args[:3]
        cu, scale = kwargs["cu_seqlens_q"], kwargs.get("scale")
        checks = [attention_alone(fn, q, k, v, cu, scale)]
        if member is not None:
            start, end, segments = member
            checks += [attention_rows(fn, q, k, v, scale, start, end, o, n) for o, n, _ in segments]
        return checks + [attention_shared(fn, q, k, v, cu, scale, plan)]
    if slot == "rotary":
        return [token_rows(name or "rotary", fn, args, plan)]
    return []


def probe(widths, shape, device, dtype, lines) -> str:
    """Row invariance of F.linear at the model's widths, the norm and MLP slots, conv, GDN and attention."""
    from patchgen.kernels import ops
    from patchgen.kernels.shared_prefix import build_plan

    generated = importlib.import_module(MODULE)
    config = config_for(widths, 4)
    table = ops.resolve(config, defaults=generated.PATCHGEN_OP_DEFAULTS)
    ids, cu, _, _ = shape_batch(shape, widths["vocab_size"], device, seed=2)
    plan = build_plan(ids, cu, **tree_settings(shape))
    if plan is None:
        raise SystemExit(f"--probe: shape {shape.name} shares nothing; pick one with a shared prompt")
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rows(*trailing, scale=1.0, fp32=False):
        """Random per-token rows in packed layout: members of a node read identical rows."""
        x = torch.randn(1, plan.compact_length, *trailing, generator=gen) * scale
        x = x.to(device=device, dtype=torch.float32 if fp32 else dtype)
        return plan.expand(x, 1)

    def weight(out, inp):
        return (torch.randn(out, inp, generator=gen) * inp**-0.5).to(device=device, dtype=dtype)

    d = widths["hidden_size"]
    h, hkv, dh = widths["num_attention_heads"], widths["num_key_value_heads"], widths["head_dim"]
    hk, hv = widths["linear_num_key_heads"], widths["linear_num_value_heads"]
    dk, dv = widths["linear_key_head_dim"], widths["linear_value_head_dim"]
    inter, vocab, width = widths["intermediate_size"], widths["vocab_size"], widths["linear_conv_kernel_dim"]
    key_dim, value_dim = hk * dk, hv * dv
    gemms = {  # name -> (in, out): every projection of the model
        "in_proj_qkv": (d, 2 * key_dim + value_dim),
        "in_proj_z": (d, value_dim),
        "in_proj_a/b": (d, hv),
        "out_proj": (value_dim, d),
        "q_proj": (d, 2 * h * dh),
        "k_proj/v_proj": (d, hkv * dh),
        "o_proj": (h * dh, d),
        "gate/up_proj": (d, inter),
        "down_proj": (inter, d),
        "lm_head": (d, vocab),
    }
    checks: list[Check] = []
    inputs = {d: rows(d), value_dim: rows(value_dim), h * dh: rows(h * dh), inter: rows(inter)}
    with torch.no_grad():
        for name, (inp, out) in gemms.items():
            checks.append(linear_rows(name, inputs[inp], weight(out, inp), plan))
        norm_w = (torch.randn(d, generator=gen) * 0.1).to(device=device, dtype=dtype)
        checks.append(
            token_rows("rms_norm slot", lambda x: table.rms_norm(x, norm_w, 1e-6), (inputs[d],), plan)
        )
        wg, wu, wd = weight(inter, d), weight(inter, d), weight(d, inter)
        checks.append(
            token_rows("swiglu_mlp slot", lambda x: table.swiglu_mlp(x, wg, wu, wd), (inputs[d],), plan)
        )
        conv_dim = 2 * key_dim + value_dim
        x, w = (
            rows(conv_dim),
            (torch.randn(conv_dim, width, generator=gen) * 0.5).to(device=device, dtype=dtype),
        )
        checks += op_checks(
            "causal_conv1d", table.causal_conv1d, (x, w, None), {"activation": "silu", "cu_seqlens": cu}, plan
        )
        q, k, v = rows(hk, dk), rows(hk, dk), rows(hv, dv)
        g = F.logsigmoid(rows(hv, fp32=True))  # the model's gate is float32 and negative
        beta = torch.sigmoid(rows(hv))
        checks += op_checks(
            "gated_delta_rule", table.gated_delta_rule, (q, k, v, g, beta), {"cu_seqlens": cu}, plan
        )
        qa, ka, va = (t.squeeze(0) for t in (rows(h, dh), rows(hkv, dh), rows(hkv, dh)))
        checks += op_checks(
            "attention", table.attention, (qa, ka, va), {"cu_seqlens_q": cu, "scale": dh**-0.5}, plan
        )
    say = lines.append
    say(
        f"== probe {shape.name}: T={plan.packed_length} C={plan.compact_length}, {str(dtype).removeprefix('torch.')} "
        f"on {device.type}; backends: "
        + ", ".join(
            f"{s} {table.backend(s)}"
            for s in ("rms_norm", "swiglu_mlp", "causal_conv1d", "gated_delta_rule", "attention")
        )
    )
    for c in checks:
        say(f"  {c.line()}")
    differ = [c.name for c in checks if not c.equal]
    return (
        f"SUMMARY row_invariance [{device.type} {str(dtype).removeprefix('torch.')}] {shape.name} T={plan.packed_length} "
        f"C={plan.compact_length}: {len(checks) - len(differ)}/{len(checks)} bit-equal"
        + (f"; NOT row-invariant: {'; '.join(differ)}" if differ else "")
    )
