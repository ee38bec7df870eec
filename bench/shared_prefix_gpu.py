"""Shared-prefix vs packed vs upstream training on one GPU, at Qwen3.5-4B widths, in one run.

    python bench/shared_prefix_gpu.py --out DIR [--shapes grid | 4x2048x256,split,...] [--layers 8]
    python bench/shared_prefix_gpu.py --tiny          # CPU smoke test of the script itself

Builds `Qwen3_5ForCausalLM` from the generated GPU module (hidden 2560, intermediate 9216, 16
attention heads of 256 with 4 KV heads, GDN 16/32 heads of 128, conv 4, vocab 151936; `--layers`
in the pattern 3 linear + 1 full), bf16, gradient checkpointing, random weights. Per shape
(n rollouts of a P-token prompt with R-token responses, whole groups in one micro-batch) it times
the training step (forward + backward) and the log-prob pass (forward only) with the flag off
(packed) and on (shared prefix), then, with only that model on the GPU, upstream transformers'
own `Qwen3_5ForCausalLM` (same weights, its default kernels, packed through `position_ids` and
`cu_seq_lens_*`). CUDA events after warm-up (Triton autotune excluded), median and spread of
repeats, peak memory per arm (absolute, and above what was allocated when the step began),
plan-build time, and host syncs per training step (`torch.cuda.set_sync_debug_mode`).
It first runs the correctness check of the generated-models issue: bf16 flag-on vs flag-off
distance of logits, loss and gradients, against the packed-vs-unpacked noise floor.
Writes `shared_prefix_<device><tag>.csv` (after every shape, so a cut run keeps what it measured)
and `correctness_<device><tag>.csv` under --out, and prints tables.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.util
import statistics
import time
import warnings
from pathlib import Path

import torch
from patchgen.kernels.shared_prefix.positions import positions_from_cu_seqlens

MODULE = "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu"
WIDTHS = dict(
    hidden_size=2560,
    intermediate_size=9216,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=151936,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    vocab_size=512,
)


def config_for(widths: dict, layers: int):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        tie_word_embeddings=False,
        use_cache=False,
        **widths,
    )
    config.shared_prefix_training = False
    return config


def checkpointed(model):
    """Activation checkpointing on every decoder layer (transformers 5.24 renamed the method)."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return model


class Shape(tuple):
    """`(name, groups, singles, system)`, unpacked as such by every script, plus how deep it is shared.

    `turns`: shared turn lengths of a multi-turn (agentic) shape: each group's rollouts branch
    `fan` ways after the prompt and after every turn, so a group has `fan ** (len(turns) + 1)`
    rollouts (its `n` is ignored) whose own last turn is `R` tokens. `depth`: the plan's
    `shared_prefix_max_depth` (None: the config default, a tree; 1: one level of sharing);
    `level_cost`: its `shared_prefix_level_cost` (None: the default; the tiny shapes use 0).
    """

    def __new__(cls, name, groups, singles, system=0, *, turns=(), fan=2, depth=None, level_cost=None):
        shape = super().__new__(cls, (name, groups, singles, system))
        shape.turns, shape.fan, shape.depth, shape.level_cost = tuple(turns), fan, depth, level_cost
        return shape

    name = property(lambda self: self[0])


def shape_batch(shape, vocab: int, device, seed: int = 0):
    """`batch` of a `Shape` (or of a plain 4-tuple)."""
    _, groups, singles, system = shape
    return batch(
        groups, singles, vocab, device, seed=seed, system=system,
        turns=getattr(shape, "turns", ()), fan=getattr(shape, "fan", 2),
    )


def tree_settings(shape) -> dict:
    """The `build_plan` keywords a shape runs with (the model reads the same from its config)."""
    from patchgen.kernels.shared_prefix import DEFAULT_MAX_DEPTH, LEVEL_COST_TOKENS

    depth, cost = getattr(shape, "depth", None), getattr(shape, "level_cost", None)
    return {
        "max_depth": DEFAULT_MAX_DEPTH if depth is None else depth,
        "level_cost": LEVEL_COST_TOKENS if cost is None else cost,
    }


def batch(
    groups: list[tuple[int, int, int]],
    singles: list[int],
    vocab: int,
    device,
    seed: int = 0,
    system: int = 0,
    turns: tuple[int, ...] = (),
    fan: int = 2,
):
    """Packed row of whole groups `(n, P, R)` then unrelated sequences; labels = input ids.

    The first `system` tokens of every group's prompt are one system prompt common to all groups.
    With `turns`, a group is a multi-turn tree: its rollouts branch `fan` ways after the prompt
    and after each turn (`fan ** (len(turns) + 1)` rollouts, `n` ignored), then `R` own tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    common = torch.randint(0, vocab, (system,), generator=gen)
    seqs = []
    for n, p, r in groups:
        prompt = torch.cat([common, torch.randint(0, vocab, (p - system,), generator=gen)])
        if turns:
            level = [prompt]
            for length in turns:
                level = [torch.cat([s, torch.randint(0, vocab, (length,), generator=gen)]) for s in level for _ in range(fan)]
            seqs += [torch.cat([s, torch.randint(0, vocab, (r,), generator=gen)]) for s in level for _ in range(fan)]
            continue
        seqs += [torch.cat([prompt, torch.randint(0, vocab, (r,), generator=gen)]) for _ in range(n)]
    seqs += [torch.randint(0, vocab, (s,), generator=gen) for s in singles]
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    ids = torch.cat(seqs).unsqueeze(0)
    return ids.to(device), cu.to(device), max(lengths), seqs


class Timer:
    """CUDA events on a GPU, the host clock (after a sync) elsewhere."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3


def packed_kwargs(cu, max_len):
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)


def train_step(model, ids, cu, max_len):
    model.zero_grad(set_to_none=True)
    out = model(
        input_ids=ids, labels=boundary_labels(ids, cu), return_logits=False, **packed_kwargs(cu, max_len)
    )
    out.loss.backward()


def logprob_pass(model, ids, cu, max_len):
    with torch.no_grad():
        model(input_ids=ids, return_log_probs=True, return_logits=False, **packed_kwargs(cu, max_len))


def upstream_train_step(model, ids, cu, max_len):
    model.zero_grad(set_to_none=True)
    out = model(
        input_ids=ids,
        position_ids=positions_from_cu_seqlens(cu, ids.shape[1]),  # how upstream detects a packed row
        labels=boundary_labels(ids, cu),
        **packed_kwargs(cu, max_len),
    )
    out.loss.backward()


def upstream_logprob_pass(model, ids, cu, max_len):
    """Upstream has no log-prob output: logits, then log-softmax gathered at the next token, as RL code does."""
    with torch.no_grad():
        positions = positions_from_cu_seqlens(cu, ids.shape[1])
        logits = model(input_ids=ids, position_ids=positions, **packed_kwargs(cu, max_len)).logits
        torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])


ARMS = {  # arm -> (flag or None for upstream, training step, log-prob pass)
    "packed": (False, train_step, logprob_pass),
    "shared": (True, train_step, logprob_pass),
    "upstream": (None, upstream_train_step, upstream_logprob_pass),
}


def measure(model, fn, args, timer, warmup, repeats, device):
    """(median, min, max) ms, peak GiB, and peak GiB above what was allocated when the step began."""
    for _ in range(warmup):
        fn(model, *args)
    cuda = device.type == "cuda"
    if cuda:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = [timer(lambda: fn(model, *args)) for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated() if cuda else float("nan")
    model.zero_grad(set_to_none=True)
    gib = 2**30
    return (
        statistics.median(times),
        min(times),
        max(times),
        peak / gib,
        (peak - resident) / gib if cuda else peak,
    )


def count_syncs(model, fn, ids, cu, max_len, device) -> int:
    """Host syncs during one call of `fn` (torch's sync debug mode reports each as a warning)."""
    if device.type != "cuda":
        return -1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(model, ids, cu, max_len)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def plan_build_ms(ids, cu, device, repeats=10, **tree) -> float:
    """Host time of `build_plan` (it copies ids and boundaries to the host, then works there)."""
    from patchgen.kernels.shared_prefix import build_plan

    def once():
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        build_plan(ids, cu, **tree)
        return (time.perf_counter() - begin) * 1e3

    once()
    return statistics.median(once() for _ in range(repeats))


def run_arm(model, arm, row, inputs, args, device, timer):
    """Time one arm's training step and log-prob pass into `row`; a failure (an OOM, say) is recorded, not fatal."""
    flag, train, logprob = ARMS[arm]
    if flag is not None:
        model.config.shared_prefix_training = flag
    repeats = args.upstream_repeats if arm == "upstream" else args.repeats
    for kind, fn in (("train", train), ("logprob", logprob)):
        try:
            med, low, high, peak, above = measure(model, fn, inputs, timer, args.warmup, repeats, device)
        except Exception as error:  # noqa: BLE001 - the run goes on; the CSV says what failed
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            row[f"{arm}_{kind}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            print(f"  {arm} {kind} failed: {row[f'{arm}_{kind}_error']}", flush=True)
            med = low = high = peak = above = float("nan")
        row[f"{arm}_{kind}_ms"], row[f"{arm}_{kind}_min"], row[f"{arm}_{kind}_max"] = med, low, high
        row[f"{arm}_{kind}_peak_gib"], row[f"{arm}_{kind}_step_gib"] = peak, above
    try:
        row[f"syncs_{arm}_train"] = count_syncs(model, train, *inputs, device)
    except Exception:  # noqa: BLE001 - already recorded above
        row[f"syncs_{arm}_train"] = float("nan")
    if flag is not None:
        model.config.shared_prefix_training = False


def ratios(row):
    if "packed_train_ms" not in row:  # an upstream-only run: merged with ours afterwards
        return
    for kind in ("train", "logprob"):
        row[f"speedup_{kind}"] = row[f"packed_{kind}_ms"] / row[f"shared_{kind}_ms"]
        row[f"efficiency_{kind}"] = row[f"speedup_{kind}"] / row["bound"]
        if f"upstream_{kind}_ms" in row:
            row[f"packed_vs_upstream_{kind}"] = row[f"upstream_{kind}_ms"] / row[f"packed_{kind}_ms"]
    row["memory_ratio_train"] = row["shared_train_peak_gib"] / row["packed_train_peak_gib"]
    row["step_memory_ratio_train"] = row["shared_train_step_gib"] / row["packed_train_step_gib"]


def shape_row(shape, vocab, device):
    """The row of one shape (its name, packed and compact lengths, bound, depth) and its packed inputs."""
    from patchgen.kernels.shared_prefix import build_plan

    ids, cu, max_len, _ = shape_batch(shape, vocab, device)
    plan = build_plan(ids, cu, **tree_settings(shape))
    compact = plan.compact_length if plan is not None else ids.shape[1]
    levels = plan.depth if plan is not None else 0
    row = {"shape": shape[0], "T": ids.shape[1], "C": compact, "bound": ids.shape[1] / compact, "levels": levels}
    return row, (
        ids,
        cu,
        max_len,
    )


def speed(model, shapes, args, device, timer, vocab, save):
    """Our two arms over every shape, each row saved as soon as it is measured."""
    rows = []
    for shape in shapes:
        name = shape[0]
        row, (ids, cu, max_len) = shape_row(shape, vocab, device)
        total, compact = row["T"], row["C"]
        tree = tree_settings(shape)
        model.config.shared_prefix_max_depth = tree["max_depth"]
        model.config.shared_prefix_level_cost = tree["level_cost"]
        for arm in ("packed", "shared"):
            run_arm(model, arm, row, (ids, cu, max_len), args, device, timer)
        row["plan_ms"] = plan_build_ms(ids, cu, device, **tree)
        ratios(row)
        rows.append(row)
        save(rows)
        print(
            f"{name}: T={total} C={compact} bound={row['bound']:.2f} train {row['packed_train_ms']:.0f} -> "
            f"{row['shared_train_ms']:.0f} ms (eff {row['efficiency_train']:.2f}), logprob {row['packed_logprob_ms']:.0f}"
            f" -> {row['shared_logprob_ms']:.0f} ms (eff {row['efficiency_logprob']:.2f}), peak "
            f"{row['packed_train_peak_gib']:.1f} -> {row['shared_train_peak_gib']:.1f} GiB "
            f"({row['memory_ratio_train']:.2f}), plan {row['plan_ms']:.2f} ms, syncs/step "
            f"{row['syncs_packed_train']}/{row['syncs_shared_train']}",
            flush=True,
        )
    return rows


def upstream_speed(model, shapes, rows, args, device, timer, vocab, save):
    """Upstream's packed arm over the same shapes, into the same rows."""
    for shape, row in zip(shapes, rows):
        name = shape[0]
        ids, cu, max_len, _ = shape_batch(shape, vocab, device)
        run_arm(model, "upstream", row, (ids, cu, max_len), args, device, timer)
        ratios(row)
        save(rows)
        print(
            f"{name}: upstream train {row['upstream_train_ms']:.0f} ms (ours packed "
            f"{row.get('packed_vs_upstream_train', float('nan')):.2f}x faster), logprob "
            f"{row['upstream_logprob_ms']:.0f} ms ({row.get('packed_vs_upstream_logprob', float('nan')):.2f}x), "
            f"peak {row['upstream_train_peak_gib']:.1f} GiB, syncs/step {row['syncs_upstream_train']}",
            flush=True,
        )


def upstream_model(model, widths, layers, device, dtype):
    """transformers' own Qwen3_5ForCausalLM with our model's weights (the parameter names are the same)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as upstream

    state = {k: v.to("cpu") for k, v in model.state_dict().items()}
    with torch.device(device):
        twin = upstream.Qwen3_5ForCausalLM(config_for(widths, layers)).to(dtype)
    twin.load_state_dict(state, strict=True)
    checkpointed(twin)
    twin.train()
    fla = importlib.util.find_spec("fla") is not None
    print(
        f"upstream: attention {twin.config._attn_implementation}, GDN "
        f"{'flash-linear-attention' if fla else 'torch (no fla)'}, conv "
        f"{'causal-conv1d' if importlib.util.find_spec('causal_conv1d') else 'torch'}",
        flush=True,
    )
    return twin


def grads_of(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def boundary_labels(ids, cu):
    """Labels = input ids, -100 at each sequence start: no token predicts across a packed boundary."""
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    return labels


def correctness_arm(model, ids, cu, max_len, flag, n_items):
    model.config.shared_prefix_training = flag
    model.zero_grad(set_to_none=True)
    labels = boundary_labels(ids, cu)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=n_items, **packed_kwargs(cu, max_len))
    out.loss.backward()
    return out.logits.detach().float(), out.loss.detach().float(), grads_of(model)


def run_unpacked(model, seqs, device, n_items):
    """Each sequence alone (no packing), losses summed with the packed normalisation."""
    model.config.shared_prefix_training = False
    model.zero_grad(set_to_none=True)
    logits, loss = [], 0.0
    for seq in seqs:
        ids = seq.unsqueeze(0).to(device)
        out = model(input_ids=ids, labels=ids, num_items_in_batch=n_items)
        out.loss.backward()
        logits.append(out.logits.detach().float())
        loss = loss + out.loss.detach().float()
    return torch.cat(logits, dim=1), loss, grads_of(model)


def distance(a, b):
    """(max |a-b|, ||a-b|| / ||b||) over tensors or dicts of tensors."""
    if isinstance(a, dict):
        pairs = [(a[k], b[k]) for k in b]
        num = sum((x - y).pow(2).sum() for x, y in pairs).sqrt()
        den = sum(y.pow(2).sum() for _, y in pairs).sqrt()
        return max((x - y).abs().max().item() for x, y in pairs), (num / den).item()
    return (a - b).abs().max().item(), ((a - b).norm() / b.norm()).item()


def correctness(model, device, vocab, shape):
    """bf16 flag on vs off on one `Shape` (a tree where it nests), against the packed-vs-unpacked floor."""
    ids, cu, max_len, seqs = shape_batch(shape, vocab, device, seed=1)
    tree = tree_settings(shape)
    model.config.shared_prefix_max_depth = tree["max_depth"]
    model.config.shared_prefix_level_cost = tree["level_cost"]
    n_items = ids.shape[1] - len(seqs)  # shifted labels: one fewer per sequence
    off = correctness_arm(model, ids, cu, max_len, False, n_items)
    on = correctness_arm(model, ids, cu, max_len, True, n_items)
    alone = run_unpacked(model, seqs, device, n_items)
    rows = []
    for i, what in enumerate(("logits", "loss", "grads")):
        sp_max, sp_rel = distance(on[i], off[i])
        nf_max, nf_rel = distance(alone[i], off[i])
        rows.append(
            {
                "shape": shape.name,
                "quantity": what,
                "shared_vs_packed_max": sp_max,
                "shared_vs_packed_rel": sp_rel,
                "noise_floor_max": nf_max,
                "noise_floor_rel": nf_rel,
                "within_2x_floor": sp_rel <= 2 * max(nf_rel, 1e-30),
            }
        )
        print(
            f"{shape.name}: {what:>6}: shared-vs-packed rel {sp_rel:.2e} (max {sp_max:.2e}); packed-vs-unpacked rel "
            f"{nf_rel:.2e} (max {nf_max:.2e})",
            flush=True,
        )
    model.config.shared_prefix_training = False
    return rows


def correctness_shapes(text: str, tiny: bool):
    """`--correctness`: `n x P x R x unrelated` cases and control names (e.g. `system-tree`), comma-separated."""
    shapes = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        if len(parts) == 4 and all(v.isdigit() for v in parts):
            n, p, r, single = (int(v) for v in parts)
            if tiny:
                p, r, single = 130, 20, 50
            shapes.append(Shape(f"n={n} P={p} R={r} + {single}", [(n, p, r)], [single]))
        elif tiny:
            shapes.append(Shape("tiny system tree", [(2, 128, 4)] * 2, [], 64, level_cost=0))
        else:
            shapes += parse_shapes(item)
    return shapes


def write(rows, path: Path):
    if not rows:
        return
    fields = list(
        dict.fromkeys(key for row in rows for key in row)
    )  # first-seen order; error columns are rare
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


GRID = [f"{n}x{p}x{r}" for n in (4, 8) for p in (1024, 2048, 4096, 8192) for r in (256, 512)]
CONTROLS = ["split", "system", "4x512x256", "system-tree", "agentic", "agentic-flat", "agentic-4"]


def parse_shapes(text: str):
    """`Shape`s `(name, groups, unrelated lengths, system-prompt tokens)`; `grid` is the whole grid plus controls.

    The grid shapes nest nothing, so their plan is the one-level plan at any depth (the tree's
    no-regression check). `system` is the one-level system-prompt control (depth 1: two groups),
    `system-tree` the same batch as a tree (C = 1024 + 2 * 512 + 8 * 256 = 4096); `agentic` is a
    3-turn agentic tree (P = 1024, two shared turns of 256 after which 8 rollouts each end in 256
    own tokens, branching in two at every turn), `agentic-flat` the same at depth 1, `agentic-4`
    four such prompts in one micro-batch.
    """
    shapes = []
    system_groups = [(4, 1536, 256), (4, 1536, 256)]
    for item in text.split(","):
        if item == "grid":
            shapes += parse_shapes(",".join(GRID + CONTROLS))
        elif item == "split":  # one group of 8 split over two micro-batches: each half is seen alone
            shapes.append(Shape("split 4of8 P=2048 R=256", [(4, 2048, 256)], []))
        elif item == "system":  # two prompts sharing only a 1k system prompt, 4 rollouts each
            shapes.append(Shape("system-only 2x4 P=1024+512 R=256", system_groups, [], 1024, depth=1))
        elif item == "system-tree":
            shapes.append(Shape("system tree 2x4 P=1024+512 R=256", system_groups, [], 1024))
        elif item in ("agentic", "agentic-flat", "agentic-4"):
            prompts, depth = (4, None) if item == "agentic-4" else (1, 1 if item == "agentic-flat" else None)
            label = {"agentic": "tree", "agentic-flat": "one level", "agentic-4": "tree, 4 prompts"}[item]
            shapes.append(
                Shape(
                    f"agentic 3 turns x2 P=1024 turn=256 R=256 ({label})",
                    [(8, 1024, 256)] * prompts,
                    [],
                    turns=(256, 256),
                    depth=depth,
                )
            )
        else:
            n, p, r = (int(v) for v in item.split("x"))
            shapes.append(Shape(f"n={n} P={p} R={r}", [(n, p, r)], []))
    return shapes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        default="grid",
        help="comma-separated n x P x R, 'split', 'system', 'system-tree', 'agentic', 'agentic-flat', "
        "'agentic-4', or 'grid' (all of them)",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--upstream-repeats", type=int, default=3)
    parser.add_argument("--no-upstream", action="store_true", help="skip upstream transformers' arm")
    parser.add_argument(
        "--upstream-only",
        action="store_true",
        help="only upstream's arm (another GPU runs ours; the CSVs merge by shape)",
    )
    parser.add_argument(
        "--correctness",
        default="3x1990x96x300",
        help="comma-separated n x P x R x unrelated length cases and control shapes (system-tree); '' skips",
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="", help="suffix of the CSV names (runs split over GPUs or calls)")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny widths on the CPU, float32 (script smoke test)"
    )
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    widths = TINY if args.tiny else WIDTHS
    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    with torch.device(device):
        model = module.Qwen3_5ForCausalLM(config_for(widths, args.layers)).to(dtype)
    checkpointed(model)
    model.train()
    from patchgen.kernels import ops

    print(ops.of(model).describe(), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = ("cpu-tiny" if args.tiny else torch.cuda.get_device_name().replace(" ", "_")) + args.tag
    if args.correctness:
        checked = correctness_shapes(args.correctness, args.tiny)
        write(
            [row for shape in checked for row in correctness(model, device, widths["vocab_size"], shape)],
            out / f"correctness_{label}.csv",
        )
    shapes = parse_shapes(args.shapes)
    if args.tiny:
        shapes = [
            Shape("tiny n=4 P=192 R=32", [(4, 192, 32)], [40]),
            Shape("tiny system", [(2, 96, 16)] * 2, [], 80, depth=1),
            Shape("tiny system tree", [(2, 128, 4)] * 2, [], 64, level_cost=0),  # C = 64 + 2 * 64 + 4 * 4
            Shape("tiny agentic", [(4, 64, 4)], [], turns=(64,), level_cost=0),
        ]
    path = out / f"shared_prefix_{label}.csv"
    timer = Timer(device)
    if args.upstream_only:
        rows = [shape_row(shape, widths["vocab_size"], device)[0] for shape in shapes]
    else:
        rows = speed(model, shapes, args, device, timer, widths["vocab_size"], lambda rows: write(rows, path))
    if not args.no_upstream:
        # Only one model on the device at a time, so that each arm's peak memory is its own.
        twin = upstream_model(model, widths, args.layers, device, dtype)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        upstream_speed(
            twin, shapes, rows, args, device, timer, widths["vocab_size"], lambda rows: write(rows, path)
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
