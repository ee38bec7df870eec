"""Random prefix trees of packed sequences (hypothesis), for the plan, mixer and model tests."""

from __future__ import annotations

import random

import torch
from hypothesis import strategies as st

# around the GDN chunk (a nested node of 63 rows must be merged into its children), and the
# conv look-back; 1 makes a node that is not one at all
NODE_LENGTHS = (1, 3, 63, 64, 65, 100, 128)


@st.composite
def prefix_trees(
    draw,
    *,
    depth=(1, 3),
    fan_out=(2, 3),
    lengths=NODE_LENGTHS,
    leaf=(1, 6),
    roots=(1, 2),
    spine=False,
    max_sequences=None,
    vocab=2000,
):
    """`(seqs, prompt_lengths, positions)`: root-to-leaf token lists in a random packed order.

    Each node draws a length and a fan-out; each child is a subtree (while depth lasts) or a leaf
    of `leaf` tokens (the response); with `spine` the first child is always a subtree, so every
    root reaches its drawn depth; past about `max_sequences` leaves no new subtree starts (small
    model tests). `prompt_lengths[i]` counts the rows of sequence `i` above its leaf. Sometimes a singleton and a zero-length segment join; positions are None, per-sequence
    `[1, T]` or M-RoPE `[3, 1, T]` rows.
    """
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))

    def toks(n):
        return [rng.randrange(1, vocab) for _ in range(n)]

    leaves = [0]

    def subtree(levels):
        head = toks(draw(st.sampled_from(lengths)))
        out = []
        for i in range(draw(st.integers(*fan_out))):
            room = max_sequences is None or leaves[0] + fan_out[1] <= max_sequences
            if levels > 1 and room and ((spine and i == 0) or draw(st.booleans())):
                out += [(head + s, head_len + len(head)) for s, head_len in subtree(levels - 1)]
            else:
                leaves[0] += 1
                out.append((head + toks(draw(st.integers(*leaf))), len(head)))
        return out

    pairs = []
    for _ in range(draw(st.integers(*roots))):
        pairs += subtree(draw(st.integers(*depth)))
    if draw(st.booleans()):
        pairs.append((toks(draw(st.integers(1, 40))), 0))
    if draw(st.booleans()):
        pairs.append(([], 0))
    rng.shuffle(pairs)
    seqs = [s for s, _ in pairs]
    prompt_lengths = [p for _, p in pairs]
    lengths_ = [len(s) for s in seqs]
    per_seq = torch.cat([torch.arange(n) for n in lengths_]).reshape(1, -1)
    positions = draw(st.sampled_from([None, per_seq, per_seq.expand(3, -1).reshape(3, 1, -1).clone()]))
    return seqs, prompt_lengths, positions


def pack(seqs):
    """(input_ids [1, T], cu_seqlens int32) of token lists."""
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, cu


def prompt_mask(seqs, prompt_lengths):
    """[1, T] True on the rows above each sequence's leaf (the prompt and earlier turns)."""
    return torch.tensor([j < p for s, p in zip(seqs, prompt_lengths) for j in range(len(s))]).reshape(1, -1)
