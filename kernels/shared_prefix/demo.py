"""A look at a shared-prefix plan: `python -m patchgen.kernels.shared_prefix.demo`.

Packs two GRPO prompts (4 rollouts each, sharing a system prompt) and a lone sequence, builds the
one-level plan and prints the groups, the compact row and each mixer's calls; then the prefix tree
of the same batch (the system prompt once, each prompt once below it).
"""

from __future__ import annotations

import torch

from .plan import DEFAULT_MAX_DEPTH, build_plan


def main() -> None:
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, 32_000, (n,), generator=gen).tolist()

    system = tokens(320)
    prompts = [system + tokens(300), system + tokens(180)]
    seqs = [p + tokens(int(r)) for p in prompts for r in torch.randint(1, 200, (4,), generator=gen)]
    seqs.insert(3, tokens(90))
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    plan = build_plan(ids, cu)

    print(plan)
    print("  one level (shared_prefix_max_depth=1):")
    for g in plan.groups:
        print(f"  group: sequences {list(g.members)} share {g.prefix_length} tokens")
    print(f"  T / C = {plan.packed_length / plan.compact_length:.2f}; LM rows L = {plan.lm.length}")
    a, b = plan.gdn.round_a, plan.gdn.round_b
    print(
        f"  GDN round A: {a.num_sequences} sequences, {a.src.numel()} rows (prefixes up to a multiple of 64, singletons)"
    )
    print(
        f"  GDN round B: {b.num_sequences} sequences, {b.src.numel()} rows (tails alone, tail + suffix per member)"
    )
    print(f"  conv: one call over {plan.conv.src.numel()} rows (look-back rows in front of every suffix)")
    att = plan.attention
    print(
        f"  attention: one call, {att.cu_seqlens_q.numel() - 1} segments, {plan.compact_length} queries, "
        f"{att.kv_src.numel()} keys, max_seqlen_q={att.max_seqlen_q}, max_seqlen_k={att.max_seqlen_k}"
    )

    tree = build_plan(ids, cu, max_depth=DEFAULT_MAX_DEPTH)
    print(f"\nprefix tree (shared_prefix_max_depth={DEFAULT_MAX_DEPTH}):")
    print(tree)
    for node in tree.nodes:
        level = _level(tree, node)
        print(f"  {'  ' * level}node: sequences {list(node.members)} share rows {node.start}..{node.end}")
    print(f"  T / C = {tree.packed_length / tree.compact_length:.2f}; LM rows L = {tree.lm.length}")
    rounds = [r.num_sequences if r is not None else 0 for r in tree.gdn.rounds]
    print(f"  GDN: {len(tree.gdn.rounds)} calls ({rounds} sequences); conv 1 call; attention 1 call")


def _level(plan, node) -> int:
    level = 0
    while node.parent is not None:
        node, level = plan.nodes[node.parent], level + 1
    return level


if __name__ == "__main__":
    main()
