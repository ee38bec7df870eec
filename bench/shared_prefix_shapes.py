"""The shapes of `bench/shared_prefix_gpu.py`: micro-batches of whole groups, the grid and its controls.

A shape is `n` rollouts of a `P`-token prompt with `R`-token responses (whole groups in one packed
row), plus control shapes (a group split over micro-batches, a system prompt common to two prompts,
multi-turn trees). `batch` draws the token ids; every arm of a run reads the same ids.
"""

from __future__ import annotations

import torch

GRID = [f"{n}x{p}x{r}" for n in (4, 8) for p in (1024, 2048, 4096, 8192) for r in (256, 512)]
CONTROLS = ["split", "system", "4x512x256", "system-tree", "agentic", "agentic-flat", "agentic-4"]


class Shape(tuple):
    """`(name, groups, singles, system)`, unpacked as such by every script, plus how deep it is shared.

    `turns`: shared turn lengths of a multi-turn (agentic) shape: each group's rollouts branch
    `fan` ways after the prompt and after every turn, so a group has `fan ** (len(turns) + 1)`
    rollouts (its `n` is ignored) whose own last turn is `R` tokens. `depth`: the plan's
    `shared_prefix_max_depth` (None: the config default, a tree; 1: one level of sharing);
    `level_cost`: its `shared_prefix_level_cost` (None: the figure measured for the device; the tiny shapes use 0).
    """

    def __new__(cls, name, groups, singles, system=0, *, turns=(), fan=2, depth=None, level_cost=None):
        shape = super().__new__(cls, (name, groups, singles, system))
        shape.turns, shape.fan, shape.depth, shape.level_cost = tuple(turns), fan, depth, level_cost
        return shape

    name = property(lambda self: self[0])


TINY_SHAPES = {  # `--tiny --shapes` names (default: all)
    "n4": Shape("tiny n=4 P=192 R=32", [(4, 192, 32)], [40]),
    "system": Shape("tiny system", [(2, 96, 16)] * 2, [], 80, depth=1),
    "system-tree": Shape(
        "tiny system tree", [(2, 128, 4)] * 2, [], 64, level_cost=0
    ),  # C = 64 + 2 * 64 + 4 * 4
    "agentic": Shape("tiny agentic", [(4, 64, 4)], [], turns=(64,), level_cost=0),
}


def tiny_shapes(text: str):
    """`--tiny`: the tiny shapes named in `text` (comma-separated), all of them for `grid`."""
    if text == "grid":
        return list(TINY_SHAPES.values())
    unknown = [item for item in text.split(",") if item not in TINY_SHAPES]
    if unknown:
        raise SystemExit(
            f"--tiny --shapes: unknown {', '.join(unknown)}; choose from {', '.join(TINY_SHAPES)} or 'grid'"
        )
    return [TINY_SHAPES[item] for item in text.split(",")]


def shape_batch(shape, vocab: int, device, seed: int = 0):
    """`batch` of a `Shape` (or of a plain 4-tuple)."""
    _, groups, singles, system = shape
    return batch(
        groups,
        singles,
        vocab,
        device,
        seed=seed,
        system=system,
        turns=getattr(shape, "turns", ()),
        fan=getattr(shape, "fan", 2),
    )


def tree_settings(shape) -> dict:
    """The `build_plan` keywords a shape runs with (the model reads the same from its config)."""
    from patchgen.kernels.shared_prefix import DEFAULT_MAX_DEPTH

    depth, cost = getattr(shape, "depth", None), getattr(shape, "level_cost", None)
    return {"max_depth": DEFAULT_MAX_DEPTH if depth is None else depth, "level_cost": cost}


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
                level = [
                    torch.cat([s, torch.randint(0, vocab, (length,), generator=gen)])
                    for s in level
                    for _ in range(fan)
                ]
            seqs += [
                torch.cat([s, torch.randint(0, vocab, (r,), generator=gen)])
                for s in level
                for _ in range(fan)
            ]
            continue
        seqs += [torch.cat([prompt, torch.randint(0, vocab, (r,), generator=gen)]) for _ in range(n)]
    seqs += [torch.randint(0, vocab, (s,), generator=gen) for s in singles]
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    ids = torch.cat(seqs).unsqueeze(0)
    return ids.to(device), cu.to(device), max(lengths), seqs


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
            parts = item.split("x")
            if len(parts) != 3 or not all(part.isdigit() for part in parts):
                raise SystemExit(
                    f"--shapes: cannot read {item!r}; give n x P x R (e.g. 4x2048x256), 'grid', 'split', "
                    "'system', 'system-tree', 'agentic', 'agentic-flat' or 'agentic-4'"
                )
            n, p, r = (int(v) for v in parts)
            shapes.append(Shape(f"n={n} P={p} R={r}", [(n, p, r)], []))
    return shapes


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
