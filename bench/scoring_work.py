"""Where the shared log-prob (scoring) pass does GPU work beyond `C / T` of the packed one: FLOPs and bytes per op group.

    python bench/scoring_work.py [--shapes 8x4096x256,4x2048x256,4x1024x256] [--layers 4] [--padded] [--out FILE]
    python bench/scoring_work.py --tiny        # tiny widths and shapes (the script's own test)

Runs the log-prob pass of `bench/shared_prefix_gpu.py` (`shared_prefix_arms.logprob_pass`: per-token
log-probs under `no_grad`, no labels, logits skipped) at the real Qwen3.5-4B widths with the flag off
(`packed`) and on (`shared`), on the CPU, and accounts every op instead of timing it:

- An op the op table routes (GDN, conv, attention, the fused LM head + log-softmax, the norms,
  rotary) is counted as the GPU kernel that serves it there (fla's chunked delta rule, flash
  attention over `cu_seqlens`, liger's fused linear cross-entropy with our row-sized chunks, fused
  norms): FLOPs and DRAM bytes from its shapes and its sequence boundaries (`slot_work`).
- Every other aten op (the projections, gathers and scatters of the shared path, copies, casts,
  elementwise work) is counted from its tensors: FLOPs from torch's flop counter (matmuls), bytes
  read and written from the sizes of its inputs and outputs (`aten_work`).

No floating op is computed: a `TorchDispatchMode` runs it on the meta device and hands back an
uninitialised tensor of the same shape (the weights are uninitialised too), so a 35k-token pass at
4B widths costs seconds and no memory; integer ops (the plan, labels, indices) run for real, so
the plan, the rows scored and every index are the ones the GPU run uses. What runs differs from
the GPU in one place: the CPU's GDN backend has no round stages, so the shared path takes the
per-round loop (with this bench's one-group shapes the rows are read in place either way).

Prints, per shape, a table of groups: packed and shared FLOPs and bytes, shared/packed against
`C / T`, and the roofline time of each (max of FLOPs / peak and bytes / bandwidth, H200 figures)
with the efficiency it predicts at 8 and 32 layers. Per-kernel serial depth of the GDN state
recurrence (chunks in the longest sequence) is printed too: it is latency, not work.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from patchgen.kernels.shared_prefix.gdn_rounds import ReferenceRounds
from shared_prefix_arms import MODULE, TINY, WIDTHS, checkpointed, config_for, logprob_pass
from shared_prefix_shapes import parse_shapes, shape_batch, tiny_shapes, tree_settings
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

# H200 SXM: dense bf16 tensor-core peak and HBM3e bandwidth (spec sheet), for the roofline column only.
PEAK_FLOPS = 989e12
BANDWIDTH = 4.8e12
CHUNK = 64  # fla's chunk

GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
INDEX = {
    "index_select", "index", "gather", "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy",
    "index_put", "take", "masked_fill", "masked_scatter",
}
COPIES = {"cat", "stack", "copy", "clone", "_to_copy", "contiguous", "expand_copy", "new_zeros", "zeros_like"}
SLOT_GROUP = {
    "gated_delta_rule": "GDN (delta rule)",
    "causal_conv1d": "conv",
    "attention": "attention",
    "cross_entropy": "LM head + log-softmax",
    "rms_norm": "norms",
    "rms_norm_gated": "norms",
    "rotary": "rotary",
}
ORDER = [
    "GEMMs (projections)", "GDN (delta rule)", "conv", "attention", "LM head + log-softmax", "norms", "rotary",
    "embedding", "gathers / scatters", "copies / casts", "elementwise", "integer bookkeeping",
]


@dataclass
class Tally:
    flops: dict = field(default_factory=lambda: defaultdict(float))
    bytes: dict = field(default_factory=lambda: defaultdict(float))
    calls: dict = field(default_factory=lambda: defaultdict(int))
    seconds: dict = field(default_factory=lambda: defaultdict(float))  # roofline time, summed per op
    ops: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0.0, 0.0]))  # (group, op) -> calls, flops, bytes
    gdn_depth: list = field(default_factory=list)  # per GDN call: chunks of its longest sequence

    def add(self, group: str, name: str, flops: float, nbytes: float):
        self.flops[group] += flops
        self.bytes[group] += nbytes
        self.calls[group] += 1
        self.seconds[group] += max(flops / PEAK_FLOPS, nbytes / BANDWIDTH)
        entry = self.ops[(group, name)]
        entry[0] += 1
        entry[1] += flops
        entry[2] += nbytes


def _size(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor view covers (a broadcast dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def aten_group(name: str, tensors_in, tensors_out) -> str:
    if not any(t.is_floating_point() for t in (*tensors_in, *tensors_out)):
        return "integer bookkeeping"
    if name in GEMMS:
        return "GEMMs (projections)"
    if name == "embedding":
        return "embedding"
    if name.rstrip("_") in INDEX:
        return "gathers / scatters"
    if name.rstrip("_") in COPIES:
        return "copies / casts"
    return "elementwise"


def aten_work(func, args, kwargs, out) -> tuple[str, str, float, float]:
    name = func.overloadpacket.__name__
    tin, tout = _tensors((args, kwargs)), _tensors(out)
    group = aten_group(name, tin, tout)
    flops = 0.0
    if func.overloadpacket in flop_registry:
        flops = float(flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out))
    elif group == "elementwise":
        flops = float(sum(t.numel() for t in tout))
    written = sum(_size(t) for t in tout)
    if name in ("index_select", "index", "gather", "take", "embedding"):
        # reads the selected rows (as many as it writes) and the index, not the whole source
        read = written + sum(_size(t) for t in tin if not t.is_floating_point())
    elif name.endswith("_") and tin:  # in place: the destination is read and written once
        read = sum(_size(t) for t in tin[1:]) + (written if name.rstrip("_") not in ("copy", "fill", "zero") else 0)
    else:
        read = sum(_size(t) for t in tin)
    return group, name, flops, float(read + written)


# ---- the GPU kernels behind the op slots ------------------------------------------------------------


def _lengths(cu, total: int) -> list[int]:
    if cu is None:
        return [total]
    c = cu.tolist()
    return [b - a for a, b in itertools.pairwise(c)]


def gdn_work(q, k, v, g, beta, cu_seqlens=None, use_qk_l2norm_in_kernel=False, **_):
    """fla's chunked delta rule forward: per chunk and value head, the chunk-local products, the WY
    solve, the state step (two K x V products) and the output; bytes: inputs, output, the per-chunk
    states written by the recurrence and read by the output kernel, and the WY intermediates."""
    rows, hv, kd, vd = q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    chunks_per = [math.ceil(n / CHUNK) for n in _lengths(cu_seqlens, rows) if n > 0]
    chunks = sum(chunks_per)
    per_chunk = 2 * (CHUNK * CHUNK * kd * 3 + CHUNK * CHUNK * vd * 2 + CHUNK * kd * vd * 3) + CHUNK**3 // 3
    flops = float(chunks * hv * per_chunk)
    el = v.element_size()
    io = sum(_size(t) for t in (q, k, v, g, beta)) + rows * hv * vd * el  # inputs + o
    states = chunks * hv * kd * vd * el * 2  # h per chunk: written, read
    wy = rows * hv * (kd + vd + vd) * el * 2  # w, u, v_new: written, read
    l2norm = 2 * (_size(q) + _size(k)) if use_qk_l2norm_in_kernel else 0  # fla's l2norm kernels: read, write
    # fla's public function makes every input contiguous first (`input_guard`): q, k, v split from the
    # conv output are copied there (the round stages get them contiguous from `gdn_rounds`, counted outside)
    copies = sum(2 * _size(t) for t in (q, k, v, g, beta) if not t.is_contiguous())
    return flops, float(io + states + wy + l2norm + copies), max(chunks_per or [0])


def attention_work(q, k, v, *, cu_seqlens_q, cu_seqlens_k, causal=True, **_):
    """Flash attention over varlen segments, causal aligned bottom-right: 4 H D per (query, key) pair;
    bytes: q and o once, K and V once per 128-row query block that reads them."""
    h, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    pairs, kv_reads = 0, 0
    for lq, lk in zip(_lengths(cu_seqlens_q, q.shape[0]), _lengths(cu_seqlens_k, k.shape[0])):
        pairs += lq * (lk - lq) + lq * (lq + 1) // 2 if causal else lq * lk
        for b0 in range(0, lq, 128):
            kv_reads += lk - lq + min(lq, b0 + 128)
    el = q.element_size()
    nbytes = 2 * q.shape[0] * h * d * el + kv_reads * hkv * d * el * 2
    return float(4 * h * d * pairs), float(nbytes)


def head_work(hidden, weight, labels, **_):
    """liger's fused linear cross-entropy (forward, no gradient): the [rows, vocab] product in chunks of
    our row budget (each chunk reads the whole weight), the logits written and read once by the CE kernel."""
    from patchgen.kernels.backends.flce import chunk_mem_const

    rows, d = hidden.shape
    vocab = weight.shape[0]
    if rows == 0:
        return 0.0, 0.0
    inc = math.ceil(vocab / (chunk_mem_const(rows, d, vocab) * d))
    chunk = min(1 << math.ceil(math.log2(math.ceil(rows / inc))), rows)
    n_chunks = math.ceil(rows / chunk)
    el = hidden.element_size()
    flops = 2.0 * rows * d * vocab + 5.0 * rows * vocab
    nbytes = n_chunks * vocab * d * el + rows * d * el + 2 * rows * vocab * el + rows * 12
    return flops, float(nbytes)


def norm_work(*tensors):
    x = tensors[0]
    read = sum(_size(t) for t in tensors)
    return float(4 * x.numel()), float(read + _size(x))


class Accountant(TorchDispatchMode):
    """Counts every aten op outside the op slots; computes no floating op (see the module docstring)."""

    def __init__(self, tally: Tally):
        super().__init__()
        self.tally = tally
        self.in_slot = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._fake(func, args, kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        if not self.in_slot and not func.is_view and func.overloadpacket.__name__ not in ("detach", "_local_scalar_dense"):
            group, name, flops, nbytes = aten_work(func, args, kwargs, out)
            self.tally.add(group, name, flops, nbytes)
        return out

    @staticmethod
    def _fake(func, args, kwargs):
        leaves = _tensors((args, kwargs))
        if func.is_view or not any(t.is_floating_point() for t in leaves):
            return NotImplemented
        meta = {}

        def to_meta(t):
            if isinstance(t, torch.Tensor):
                m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                meta[id(m)] = t
                return m
            return t

        try:
            result = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except Exception:  # noqa: BLE001 - data-dependent on the meta device: computed for real
            return NotImplemented

        def back(m):
            if not isinstance(m, torch.Tensor):
                return m
            if id(m) in meta:  # in place / out=: the very tensor given
                return meta[id(m)]
            return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device="cpu")

        return tree_map(back, result)


def wrap_slots(model, tally: Tally, accountant: Accountant):
    """Count each op slot as its GPU kernel (and nothing inside it); restored by the returned callable."""
    from patchgen.kernels import ops

    table = ops.of(model)
    saved = {}

    def counted(slot, fn, work):
        def call(*args, **kwargs):
            accountant.in_slot += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                accountant.in_slot -= 1
            result = work(*args, **kwargs)
            if slot == "gated_delta_rule":
                flops, nbytes, depth = result
                tally.gdn_depth.append(depth)
            else:
                flops, nbytes = result
            tally.add(SLOT_GROUP[slot], slot, flops, nbytes)
            return out

        # attributes the slot's callers read (the conv's `look_back`); a dispatching object has no __dict__
        for attr, value in getattr(fn, "__dict__", {}).items():
            setattr(call, attr, value)
        return call

    def conv_call(x, weight, bias=None, **_):
        return 2.0 * x.shape[1] * x.shape[2] * weight.shape[-1], 2.0 * _size(x) + _size(weight)

    works = {
        "gated_delta_rule": gdn_work,
        "causal_conv1d": conv_call,
        "attention": attention_work,
        "cross_entropy": lambda hidden, weight, labels, **kw: head_work(hidden, weight, labels),
        "rms_norm": lambda x, weight, eps: norm_work(x, weight),
        "rms_norm_gated": lambda x, gate, weight, eps: norm_work(x, gate, weight),
        "rotary": lambda q, k, cos, sin: tuple(a + b for a, b in zip(norm_work(q, cos, sin), norm_work(k, cos, sin))),
    }
    for slot, work in works.items():
        fn = getattr(table, slot)
        saved[slot] = fn
        wrapped = counted(slot, fn, work)
        if slot == "gated_delta_rule" and getattr(fn, "rounds", None) is None:
            # the GPU backends (fla, ours) run a layer's rounds in one node from their stages: one gather
            # per input for every round; the CPU reference gets the naive stages, so the same path runs here
            wrapped.rounds = CountedRounds(wrapped, tally, accountant)
        look_back = getattr(fn, "look_back", None)
        if look_back is not None:
            wrapped.look_back = LookBackCounted(look_back, counted("causal_conv1d", look_back.forward,
                                                                   lambda x, weight, bias, state, idx, act: conv_call(x, weight)))
        object.__setattr__(table, slot, wrapped)
    return lambda: [object.__setattr__(table, s, f) for s, f in saved.items()]


class CountedRounds(ReferenceRounds):
    """The reference's round stages, its l2norm counted as the GDN backend's l2norm kernel (read x, write y)."""

    def __init__(self, gdn_fn, tally: Tally, accountant: Accountant):
        super().__init__(gdn_fn)
        self.tally, self.accountant = tally, accountant

    def l2norm_fwd(self, x):
        self.accountant.in_slot += 1
        try:
            out = super().l2norm_fwd(x)
        finally:
            self.accountant.in_slot -= 1
        self.tally.add(SLOT_GROUP["gated_delta_rule"], "l2norm", float(3 * x.numel()), float(2 * _size(x)))
        return out


class LookBackCounted:
    """A conv backend's state kernels with the forward counted as the conv kernel."""

    def __init__(self, inner, forward):
        self._inner, self.forward = inner, forward

    def __getattr__(self, name):
        return getattr(self._inner, name)


def build_model(layers: int, widths: dict = WIDTHS):
    import importlib

    module = importlib.import_module(MODULE)
    with torch.device("meta"):
        model = module.Qwen3_5ForCausalLM(config_for(widths, layers)).to(torch.bfloat16)
    model = model.to_empty(device="cpu")  # uninitialised: no floating op is computed
    checkpointed(model)
    return model.train()


def account(model, shape, flag: bool, padded: bool = False) -> tuple[Tally, dict]:
    """One log-prob pass counted; `padded`: the plan padded to its bucket, as the graphed scoring forward runs it."""
    from patchgen.kernels.modeling import shared_prefix
    from patchgen.kernels.modeling.shared_prefix import observe_plans

    ids, cu, max_len, _ = shape_batch(shape, model.config.vocab_size, torch.device("cpu"))
    model.config.shared_prefix_training = flag
    settings = tree_settings(shape)
    model.config.shared_prefix_max_depth = settings["max_depth"]
    model.config.shared_prefix_level_cost = settings["level_cost"]
    tally = Tally()
    seen = {}
    accountant = Accountant(tally)
    restore = wrap_slots(model, tally, accountant)
    pads = shared_prefix.pads_to_bucket
    if padded:  # the graphs need CUDA; their plan is this one (`bucket.py`), run eagerly here
        shared_prefix.pads_to_bucket = lambda config: True
    try:
        with observe_plans(lambda plan, t: seen.update(plan=plan, T=t)), accountant:
            logprob_pass(model, ids, cu, max_len)
    finally:
        shared_prefix.pads_to_bucket = pads
        restore()
        model.config.shared_prefix_training = False
    plan = seen.get("plan")
    info = {"T": ids.shape[1], "C": plan.compact_length if plan is not None else ids.shape[1]}
    if plan is not None:
        info["rows"] = plan.position_ids.shape[-1]  # the row the layers run (the padded bucket, when padded)
    return tally, info


def fmt(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


# Latency model (assumptions, from checked-in H200 profiles): an op costs at least OP_FLOOR of GPU time,
# and the GDN state recurrence (fla's fwd_h) at least STEP_US per chunk of the longest sequence of its call
# (docs/bench/triton_ncu_fla_gdn_NVIDIA_H200_triton371.txt: 187-210 us for 64 chunks, one wave).
OP_FLOOR_US = 2.5
STEP_US = 3.0


def modelled_us(t: Tally) -> float:
    """Roofline of every op, raised to the op floor, plus the serial GDN steps beyond their roofline."""
    total = 0.0
    for calls, flops, nbytes in t.ops.values():
        total += max(max(flops / PEAK_FLOPS, nbytes / BANDWIDTH) * 1e6, calls * OP_FLOOR_US)
    return total + sum(t.gdn_depth) * STEP_US


def report(title: str, layers: int, packed: Tally, shared: Tally, info: dict, top: int, file):
    t, c = info["T"], info["C"]
    bound = c / t
    rows = info.get("rows", c)
    print(f"\n=== {title}, {layers} layers: T={t} C={c} (layers run {rows} rows) C/T={bound:.3f} "
          f"(bound T/C={t / c:.2f})", file=file)
    print(f"{'group':24} {'packed FLOP':>12} {'shared FLOP':>12} {'ratio':>6} {'packed B':>11} {'shared B':>11} "
          f"{'ratio':>6} {'packed us':>10} {'shared us':>10} {'excess us':>10} {'ops p/s':>11}", file=file)
    groups = [g for g in ORDER if g in packed.calls or g in shared.calls]
    for g in groups:
        pf, sf, pb, sb = packed.flops[g], shared.flops[g], packed.bytes[g], shared.bytes[g]
        ps, ss = packed.seconds[g] * 1e6, shared.seconds[g] * 1e6
        print(f"{g:24} {fmt(pf, ''):>12} {fmt(sf, ''):>12} {sf / pf if pf else float('nan'):6.3f} "
              f"{fmt(pb, 'B'):>11} {fmt(sb, 'B'):>11} {sb / pb if pb else float('nan'):6.3f} {ps:10.0f} {ss:10.0f} "
              f"{ss - bound * ps:10.0f} {packed.calls[g]:>5}/{shared.calls[g]:<5}", file=file)
    pt, st = sum(packed.seconds.values()), sum(shared.seconds.values())
    pf, sf = sum(packed.flops.values()), sum(shared.flops.values())
    pb, sb = sum(packed.bytes.values()), sum(shared.bytes.values())
    print(f"{'total':24} {fmt(pf, ''):>12} {fmt(sf, ''):>12} {sf / pf:6.3f} {fmt(pb, 'B'):>11} {fmt(sb, 'B'):>11} "
          f"{sb / pb:6.3f} {pt * 1e6:10.0f} {st * 1e6:10.0f} {(st - bound * pt) * 1e6:10.0f} "
          f"{sum(packed.calls.values()):>5}/{sum(shared.calls.values()):<5}", file=file)
    print(f"roofline efficiency (work only) at {layers} layers: {(pt / st) / (t / c):.3f}", file=file)
    if packed.gdn_depth:
        per_layer = len(shared.gdn_depth) // len(packed.gdn_depth)
        print(f"GDN state recurrence, serial chunk steps per layer (latency, not work): packed {packed.gdn_depth[0]}, "
              f"shared {sum(shared.gdn_depth[:per_layer])} (rounds {shared.gdn_depth[:per_layer]})", file=file)
    pm, sm = modelled_us(packed), modelled_us(shared)
    print(f"latency model (op floor {OP_FLOOR_US} us, {STEP_US} us per serial GDN step): packed {pm:.0f} us, "
          f"shared {sm:.0f} us, efficiency {(pm / sm) / (t / c):.3f}", file=file)
    print("top shared ops by roofline excess over C/T x packed (group, op: calls, FLOP, bytes):", file=file)
    lines = []
    for key, (calls, flops, nbytes) in shared.ops.items():
        pc, pf_, pb_ = packed.ops.get(key, (0, 0.0, 0.0))
        excess = max(flops / PEAK_FLOPS, nbytes / BANDWIDTH) - bound * max(pf_ / PEAK_FLOPS, pb_ / BANDWIDTH)
        lines.append((excess, key, calls, flops, nbytes, pc, pf_, pb_))
    for excess, (g, op), calls, flops, nbytes, pc, pf_, pb_ in sorted(lines, key=lambda r: r[0], reverse=True)[:top]:
        print(f"  {g:22} {op:18} shared {calls:4d} x {fmt(flops, 'FLOP'):>11} {fmt(nbytes, 'B'):>10} | packed {pc:4d} x "
              f"{fmt(pf_, 'FLOP'):>11} {fmt(pb_, 'B'):>10} | excess {excess * 1e6:8.1f} us", file=file)


FIXED_GROUPS = ("embedding", "LM head + log-softmax")  # once per pass; every other group is per layer


def projected(t: Tally, layers: int, depth: int) -> tuple[float, float]:
    """(roofline s, modelled us) at `depth` layers from a count at `layers`: the per-layer part scaled."""
    k = depth / layers
    fixed = sum(t.seconds[g] for g in FIXED_GROUPS)
    roof = fixed + k * (sum(t.seconds.values()) - fixed)
    fixed_m = sum(
        max(max(f / PEAK_FLOPS, b / BANDWIDTH) * 1e6, c * OP_FLOOR_US)
        for (g, _), (c, f, b) in t.ops.items() if g in FIXED_GROUPS
    )
    return roof, fixed_m + k * (modelled_us(t) - fixed_m)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help="default 8x4096x256,4x2048x256,4x1024x256 (--tiny: n4)")
    parser.add_argument("--tiny", action="store_true", help="tiny widths and shapes: a seconds-long check of the script")
    parser.add_argument("--layers", type=int, default=4, help="a multiple of 4 (3 GDN + 1 attention layers each)")
    parser.add_argument("--padded", action="store_true",
                        help="also the plan padded to its bucket (what the graphed scoring forward runs)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    model = build_model(args.layers, TINY if args.tiny else WIDTHS)
    shapes = (tiny_shapes(args.shapes or "n4") if args.tiny
              else parse_shapes(args.shapes or "8x4096x256,4x2048x256,4x1024x256"))
    results = []
    files = [sys.stdout] + ([open(args.out, "w")] if args.out else [])  # noqa: SIM115
    for f in files:
        print(f"scoring-pass work (bench/scoring_work.py), {'tiny' if args.tiny else 'Qwen3.5-4B'} widths, bf16, {args.layers} layers counted; "
              f"roofline {PEAK_FLOPS / 1e12:.0f} TFLOP/s, {BANDWIDTH / 1e12:.1f} TB/s (H200 spec)", file=f)
    for shape in shapes:
        packed, info = account(model, shape, False)
        arms = [("shared", False)] + ([("shared, bucket-padded", True)] if args.padded else [])
        for arm, padded in arms:
            shared, info_shared = account(model, shape, True, padded=padded)
            if not padded:  # the bound is T over the real compact row; a padded plan's layers run more rows
                info["C"] = info_shared["C"]
            info["rows"] = info_shared.get("rows", info["C"])
            results.append((shape.name, arm, packed, shared, dict(info)))
            for f in files:
                report(f"{shape.name} {arm}", args.layers, packed, shared, info, args.top, f)
                bound = info["T"] / info["C"]
                for depth in (8, 32):
                    (pr, pm), (sr, sm) = projected(packed, args.layers, depth), projected(shared, args.layers, depth)
                    print(f"projected to {depth} layers: roofline {pr * 1e3:.1f} -> {sr * 1e3:.1f} ms "
                          f"(efficiency {(pr / sr) / bound:.3f}); latency model {pm / 1e3:.1f} -> {sm / 1e3:.1f} ms "
                          f"(efficiency {(pm / sm) / bound:.3f})", file=f)
    for f in files[1:]:
        f.close()
    return results


if __name__ == "__main__":
    main()
