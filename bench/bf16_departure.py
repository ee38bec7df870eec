"""Where do the packed and the shared-prefix forwards first differ, and which op is not row-invariant?

    python bench/bf16_departure.py [--layers 8] [--shapes 4x2048x256,system-tree] [--dtype bf16]
    python bench/bf16_departure.py --probe [--shapes 4x2048x256]        # the ops alone, no model
    python bench/bf16_departure.py --tiny [--probe] [--dtype fp32]      # CPU, tiny widths (script test)

Builds the bench's model (`shared_prefix_arms.our_model`: the generated GPU module at 4B widths,
random weights, training mode) and, per shape (`shared_prefix_shapes`), runs one forward with the
flag off (packed) and one with it on (shared), recording every module's output and every mixer
op's call (`departure_capture.py`). Each shared record is mapped back to the packed layout through
the plan (every packed position of a shared node reads the node's compact row) and compared with
the packed one: max |diff|, relative difference, bit-equal. The report lists every record in
execution order, names the FIRST where the two depart and whether its inputs were still
bit-equal (then that op made the difference), and replays that op on the packed call's own inputs
(`row_invariance.py`, `departure_probe.py`): a token-wise op on `M = T` against `M = C` rows; a
mixer op with each sequence alone against the varlen batch, the shared path's call against the
packed call, and the first shared sequence cut along its path through the tree (GDN with the final
state handed on at each node's last whole chunk, attention one segment's queries at a time). Every
op of the first GDN and attention layers and the LM head is replayed likewise (`--replays all`, the
default). Then loss, logits and log-probs; if only those depart, the LM head is replayed on
identical hidden rows. `--probe` runs the same op checks on random inputs at the model's widths.
Ends with one `SUMMARY` line per shape (and per probe).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from departure_capture import Capture, recording
from departure_probe import op_checks, probe
from row_invariance import (
    Check,
    compact_like,
    compare,
    expand_like,
    linear_rows,
    token_rows,
)
from shared_prefix_arms import MODULE, TINY, WIDTHS, boundary_labels, our_model, packed_kwargs
from shared_prefix_shapes import parse_shapes, shape_batch, tiny_shapes, tree_settings

INPUTS = {True: "inputs equal", False: "inputs differ", None: "inputs not comparable"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


# ---- the model run -----------------------------------------------------------------------------


def forward(model, ids, cu, max_len, *, shared: bool, capture: Capture):
    """One training-mode forward (grad on, as the training step's) with everything recorded; returns (output, plan)."""
    from patchgen.kernels.modeling.shared_prefix import observe_plans

    plans = []
    model.config.shared_prefix_training = shared
    try:
        with (
            observe_plans(lambda plan, _: plans.append(plan)),
            recording(model, capture, shared=shared, module_name=MODULE),
        ):
            out = model(
                input_ids=ids,
                labels=boundary_labels(ids, cu),
                return_log_probs=True,
                **packed_kwargs(cu, max_len),
            )
    finally:
        model.config.shared_prefix_training = False
    plan = plans[-1] if plans else None
    if shared and plan is None:
        raise SystemExit("the shape shares nothing: no plan was built, so there is no shared path to compare")
    return out, plan


def compare_records(packed: Capture, shared: Capture, plan) -> list[dict]:
    """Every packed record against its shared twin (mapped to the packed layout), in execution order."""
    rows = []
    for name, p in packed.records.items():
        s = shared.records.get(name)
        row = {"name": name, "kind": _kind(p), "checks": [], "note": ""}
        if s is None:
            row["note"] = "not called on the shared path"
        elif len(s.outputs) != len(p.outputs):
            row["note"] = f"{len(p.outputs)} output tensors packed, {len(s.outputs)} shared"
        else:
            for i, (a, b) in enumerate(zip(s.outputs, p.outputs)):
                mapped = expand_like(plan, a, b.shape)
                if mapped is None or mapped.dtype != b.dtype:
                    row["note"] = (
                        f"output {i}: shared {tuple(a.shape)} {a.dtype} has no packed twin {tuple(b.shape)}"
                    )
                    continue
                row["checks"].append(compare(f"{name}[{i}]" if len(p.outputs) > 1 else name, mapped, b))
            row["inputs_equal"] = _inputs_equal(p, s, plan)
        rows.append(row)
    return rows


def _kind(record) -> str:
    return type(record.module).__name__ if record.module is not None else "op"


def _inputs_equal(p, s, plan) -> bool | None:
    """Whether every per-token tensor input of the shared call equals the packed one (mapped); None if none is."""
    pairs = [
        (a, b) for a, b in zip(s.args, p.args) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    ]
    if p.module is None and p.name.endswith(("<causal_conv1d>", "<gated_delta_rule>", "<attention>")):
        # the shared op is called as (plan, slot function, inputs...)
        pairs = [
            (a, b)
            for a, b in zip(s.args[2:], p.args)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        ]
    pairs += [
        (s.kwargs[key], b)
        for key, b in p.kwargs.items()
        if isinstance(b, torch.Tensor) and isinstance(s.kwargs.get(key), torch.Tensor)
    ]
    verdicts = []
    for a, b in pairs:
        if not _per_token(b, plan):
            continue  # a weight, boundaries: not rows of the packed row
        mapped = expand_like(plan, a, b.shape)
        if mapped is not None and mapped.dtype == b.dtype:
            verdicts.append(bool(torch.equal(mapped, b)))
    return all(verdicts) if verdicts else None


def departed(row) -> bool:
    return any(not c.equal for c in row["checks"])


def replay(record, table, plan, capture: Capture) -> list[Check]:
    """The departing op again, on the packed call's own inputs, in the two calls that pair packed and shared."""
    with capture.paused(), torch.no_grad():
        if record.module is not None:
            if isinstance(record.module, torch.nn.Linear):
                return [
                    linear_rows(record.name, record.args[0], record.module.weight, plan, record.module.bias)
                ]
            if record.kwargs or any(
                not _per_token(a, plan) for a in record.args if isinstance(a, torch.Tensor)
            ):
                return []  # not a token-wise module: its children say more
            return [token_rows(f"{record.name} ({_kind(record)})", record.module, record.args, plan)]
        slot = record.name.rsplit(".<", 1)[1].rstrip(">").split("#")[0]
        fn = getattr(table, slot)
        return op_checks(slot, fn, record.args, record.kwargs, plan, name=record.name)


def _per_token(x, plan) -> bool:
    try:
        compact_like(plan, x)
    except ValueError:
        return False
    return True


def head_replay(model, hidden: torch.Tensor, ids, cu, plan) -> list[Check]:
    """The LM head (loss and log-probs) on identical hidden rows: packed (`T` rows) vs the shared head (deduped rows)."""
    from patchgen.kernels import ops
    from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head

    request = HeadRequest(log_probs=True, logits=False)
    common = dict(
        labels=boundary_labels(ids, cu), input_ids=ids, request=request, kwargs={"cu_seq_lens_q": cu}
    )
    with torch.no_grad():
        packed = causal_lm_head(model.lm_head, ops.of(model), hidden, plan=None, **common)
        shared = causal_lm_head(model.lm_head, ops.of(model), plan.compact(hidden, 1), plan=plan, **common)
    return [
        compare("LM head loss on identical hidden rows (deduped rows vs T rows)", shared.loss, packed.loss),
        compare("LM head log-probs on identical hidden rows", shared.log_probs, packed.log_probs),
    ]


def replay_every_op(packed: Capture, table, plan, layer_types, say) -> list[str]:
    """Every op of the first GDN layer and of the first attention layer, and the LM head's projection,
    replayed on the packed inputs they were given: which ops are not row-invariant at real activations
    (after the first departure every later input differs, so the comparison above cannot tell)."""
    layers = [
        layer_types.index(kind) for kind in ("linear_attention", "full_attention") if kind in layer_types
    ]
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    variant = []
    say(f"replays of every op of layers {layers} and the LM head on their packed inputs:")
    for name, record in packed.records.items():
        if not (name.startswith(prefixes) or name == "lm_head"):
            continue
        for check in replay(record, table, plan, packed):
            say(f"  {check.line()}")
            if not check.equal:
                variant.append(check.name)
    return variant


def _replay_summary(checks: list[Check]) -> str:
    """`k/n bit-equal`, then the checks that differ (the row-variant calls), for the SUMMARY line."""
    differ = [c for c in checks if not c.equal]
    text = f"{len(checks) - len(differ)}/{len(checks)} bit-equal"
    return text + "".join(f"; NOT: {c.name} (max {c.max_abs:.1e})" for c in differ)


def run_shape(model, shape, vocab, device, lines, replay_all: bool = True) -> str:
    """Packed vs shared on one shape; appends the report to `lines`, returns the SUMMARY line."""
    from patchgen.kernels import ops

    ids, cu, max_len, _ = shape_batch(shape, vocab, device, seed=1)
    tree = tree_settings(shape)
    model.config.shared_prefix_max_depth = tree["max_depth"]
    model.config.shared_prefix_level_cost = tree["level_cost"]
    packed, shared = Capture(), Capture()
    out_p, _ = forward(model, ids, cu, max_len, shared=False, capture=packed)
    out_s, plan = forward(model, ids, cu, max_len, shared=True, capture=shared)
    rows = compare_records(packed, shared, plan)
    say = lines.append
    say(f"== {shape.name}: T={plan.packed_length} C={plan.compact_length} depth={plan.depth} ({plan!r})")
    say(f"{'record (execution order)':<58} {'kind':<22} {'bit-equal':<9} {'max abs':>10} {'rel':>10}  inputs")
    for row in rows:
        for c in row["checks"]:
            inputs = {True: "equal", False: "differ", None: "-"}[row.get("inputs_equal")]
            say(f"{c.name:<58} {row['kind']:<22} {c.equal!s:<9} {c.max_abs:>10.3e} {c.rel:>10.3e}  {inputs}")
        if row["note"]:
            say(f"{row['name']:<58} {row['kind']:<22} ({row['note']})")
    heads = [
        compare("loss", out_s.loss.detach(), out_p.loss.detach()),
        compare("logits", out_s.logits.detach(), out_p.logits.detach()),
        compare("log_probs", out_s.log_probs.detach(), out_p.log_probs.detach()),
    ]
    for c in heads:
        say(f"  {c.line()}")
    say(f"  loss packed {out_p.loss.item():.6f} shared {out_s.loss.item():.6f}")
    first = next((row for row in rows if departed(row)), None)
    # where a difference is made: equal inputs, unequal outputs, and no departing child to blame
    gone = [row["name"] for row in rows if departed(row)]
    origins = [
        row
        for row in rows
        if departed(row)
        and row.get("inputs_equal")
        and not any(other.startswith(row["name"] + ".") for other in gone)
    ]
    table = ops.of(model)
    if first is None:
        verdict = "no module or op departs"
        if not all(c.equal for c in heads):
            checks = head_replay(model, packed.records["model.norm"].outputs[0], ids, cu, plan)
            for c in checks:
                say(f"  replay: {c.line()}")
            verdict += "; LM head replay: " + _replay_summary(checks)
    else:
        worst = max(first["checks"], key=lambda c: c.max_abs)
        inputs = {
            True: "inputs bit-equal: this op made the difference",
            False: "inputs already differ",
            None: "inputs not comparable",
        }[first.get("inputs_equal")]
        say(
            f"FIRST departure: {first['name']} ({first['kind']}): max {worst.max_abs:.3e} rel {worst.rel:.3e}; {inputs}"
        )
        checks = replay(packed.records[first["name"]], table, plan, packed)
        for c in checks:
            say(f"  replay on the packed inputs: {c.line()}")
        if not checks:
            say("  (no replay for this record: see its children above)")
        say(
            f"ops whose inputs were equal and outputs not ({len(origins)}): "
            + ", ".join(row["name"] for row in origins[:12])
            + (" ..." if len(origins) > 12 else "")
        )
        verdict = (
            f"first departure {first['name']} ({first['kind']}, max {worst.max_abs:.2e} rel {worst.rel:.2e}, "
            f"{INPUTS[first.get('inputs_equal')]})"
            + (f"; replay: {_replay_summary(checks)}" if checks else "")
        )
    if replay_all:
        variant = replay_every_op(packed, table, plan, model.config.layer_types, say)
        verdict += f"; row-variant on recorded inputs: {', '.join(variant) if variant else 'none'}"
    return (
        f"SUMMARY bf16_departure [{device.type} {str(model.dtype).removeprefix('torch.')} "
        f"{model.config.num_hidden_layers}L] {shape.name}: loss {out_p.loss.item():.6f}/{out_s.loss.item():.6f} "
        f"bit-equal {heads[0].equal}, logits bit-equal {heads[1].equal} (rel {heads[1].rel:.1e}); {verdict}"
    )


# ---- the run ---------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (a multiple of 4)")
    parser.add_argument(
        "--shapes",
        default=None,
        help="comma-separated shapes of shared_prefix_shapes (n x P x R, system-tree, ...); default "
        "4x2048x256,system-tree (--tiny: n4,system-tree)",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--probe", action="store_true", help="the ops alone on random inputs, no model")
    parser.add_argument("--tiny", action="store_true", help="tiny widths and shapes on the CPU (script test)")
    parser.add_argument(
        "--replays",
        choices=("all", "first"),
        default="all",
        help="replay every op of the first GDN and attention layers and the LM head (all), or only the first departure",
    )
    parser.add_argument(
        "--out", default=None, help="also write the report to DIR/bf16_departure_<device>.txt"
    )
    args = parser.parse_args(argv)
    if args.layers < 4 or args.layers % 4:
        raise SystemExit(
            f"--layers: {args.layers} is not a multiple of 4 (3 linear + 1 full attention); give 4, 8, ..."
        )
    if args.shapes is None:
        args.shapes = "n4,system-tree" if args.tiny else "4x2048x256,system-tree"
    return args


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = DTYPES[args.dtype]
    widths = TINY if args.tiny else WIDTHS
    shapes = tiny_shapes(args.shapes) if args.tiny else parse_shapes(args.shapes)
    lines, summaries, began = [], [], time.perf_counter()
    if args.probe:
        for shape in shapes:
            summaries.append(probe(widths, shape, device, dtype, lines))
    else:
        model = our_model(widths, args.layers, device, dtype)
        from patchgen.kernels import ops

        lines.append(ops.of(model).describe())
        for shape in shapes:
            summaries.append(
                run_shape(model, shape, widths["vocab_size"], device, lines, args.replays == "all")
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    lines += summaries
    lines.append(f"done in {time.perf_counter() - began:.1f} s")
    print("\n".join(lines), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        label = (
            "cpu-tiny"
            if args.tiny
            else (torch.cuda.get_device_name().replace(" ", "_") if device.type == "cuda" else "cpu")
        )
        (out / f"bf16_departure_{label}{'_probe' if args.probe else ''}.txt").write_text(
            "\n".join(lines) + "\n"
        )
    return summaries


if __name__ == "__main__":
    main()
