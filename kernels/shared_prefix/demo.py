"""A look at a shared-prefix plan: `python -m patchgen.kernels.shared_prefix.demo`.

Packs two GRPO prompts (4 rollouts each, one sharing only a system prompt with the other) and a
lone sequence, builds the plan, and prints the groups, the compact row and each mixer's calls.
"""

from __future__ import annotations

import torch

from .plan import build_plan


def main() -> None:
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, 32_000, (n,), generator=gen).tolist()

    system = tokens(64)
    prompts = [system + tokens(300), system + tokens(180)]
    seqs = [p + tokens(int(r)) for p in prompts for r in torch.randint(1, 200, (4,), generator=gen)]
    seqs.insert(3, tokens(90))
    ids = torch.tensor([t for s in seqs for t in s]).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    plan = build_plan(ids, cu)

    print(plan)
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


if __name__ == "__main__":
    main()
