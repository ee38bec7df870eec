"""The compact row: where each group's prefix, each member's suffix and each singleton land.

Host code. Per group `[prefix (from its first member) | suffix_1 | ... | suffix_n]`, singletons
whole, blocks in packed order (a group sits where its first member sat). Everything the mixers
index is derived from this one description, so they cannot disagree about the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .grouping import Group


def ranges(starts, lengths) -> np.ndarray:
    """Concatenation of `arange(s, s + n)` for every `(s, n)`, without a Python loop over rows."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def boundaries(lengths) -> np.ndarray:
    """cu_seqlens of consecutive segments with these lengths."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=out[1:])
    return out


@dataclass(frozen=True)
class GroupBlock:
    group: Group
    prefix_start: int  # compact row of prefix row 0
    suffix_starts: tuple[int, ...]  # compact row of each member's first suffix row, members in packed order
    suffix_lengths: tuple[int, ...]

    @property
    def prefix_length(self) -> int:
        return self.group.prefix_length


@dataclass(frozen=True)
class SingleBlock:
    sequence: int
    start: int  # compact row of its first row
    length: int  # may be 0 (zero-length segments keep their place)


@dataclass(frozen=True)
class Layout:
    cu: tuple[int, ...]  # packed sequence boundaries (host copy)
    blocks: tuple[GroupBlock | SingleBlock, ...]  # compact order
    compact_src: np.ndarray  # [C] packed row of each compact row
    expand_index: np.ndarray  # [T] compact row of each packed row

    @property
    def packed_length(self) -> int:
        return self.cu[-1]

    @property
    def compact_length(self) -> int:
        return len(self.compact_src)

    @property
    def group_blocks(self) -> list[GroupBlock]:
        return [b for b in self.blocks if isinstance(b, GroupBlock)]


def build_layout(groups: list[Group], cu: list[int]) -> Layout:
    group_of_first = {grp.members[0]: grp for grp in groups}
    in_group = {s for grp in groups for s in grp.members}
    blocks: list[GroupBlock | SingleBlock] = []
    src_starts: list[int] = []  # packed ranges that make up the compact row, in order
    src_lengths: list[int] = []
    followers: list[tuple[int, int, int]] = []  # (packed start, compact start, length): non-first prefixes
    pos = 0
    for s in range(len(cu) - 1):
        if s in group_of_first:
            grp = group_of_first[s]
            p = grp.prefix_length
            prefix_start = pos
            src_starts.append(cu[s])
            src_lengths.append(p)
            pos += p
            starts, lengths = [], []
            for m in grp.members:
                r = cu[m + 1] - cu[m] - p
                src_starts.append(cu[m] + p)
                src_lengths.append(r)
                starts.append(pos)
                lengths.append(r)
                pos += r
                if m != s:
                    followers.append((cu[m], prefix_start, p))
            blocks.append(GroupBlock(grp, prefix_start, tuple(starts), tuple(lengths)))
        elif s not in in_group:
            n = cu[s + 1] - cu[s]
            blocks.append(SingleBlock(s, pos, n))
            src_starts.append(cu[s])
            src_lengths.append(n)
            pos += n
    compact_src = ranges(src_starts, src_lengths)
    expand_index = np.empty(cu[-1], dtype=np.int64)
    expand_index[compact_src] = np.arange(len(compact_src), dtype=np.int64)
    if followers:
        f_packed, f_compact, f_len = zip(*followers)
        expand_index[ranges(f_packed, f_len)] = ranges(f_compact, f_len)
    return Layout(tuple(cu), tuple(blocks), compact_src, expand_index)
