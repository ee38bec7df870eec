"""The compact row: where every node of the prefix tree, every leaf and every singleton land.

Host code. Depth first from each root: `[node | child subtrees...]`, children ordered by their
first member, where a child is a nested node or a member's own remainder (a leaf); sequences in no
node stay whole (singletons); roots and singletons in packed order. With one level this is
`[prefix | suffix_1 | ... | suffix_n]` per group. Everything the mixers index is derived from
this one description (`Segment`s), so they cannot disagree about the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import Node


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
class Segment:
    """A run of compact rows: a shared node (`node` set), a member's leaf, or a whole singleton."""

    start: int  # compact row of its first row
    length: int  # 0 only for a zero-length singleton
    offset: int  # offset inside its sequences of its first row (sum of its ancestors' lengths)
    members: tuple[int, ...]  # packed sequences holding these rows; the first one is the source
    parent: int  # index of the parent segment, -1 for roots and singletons
    level: int  # 0 for roots and singletons
    node: int | None  # index into the plan's nodes for a shared node, None for a leaf / singleton
    children: tuple[int, ...] = ()  # child segments, in compact order (nodes only)

    @property
    def end(self) -> int:
        """Offset inside its sequences just past its last row."""
        return self.offset + self.length

    @property
    def shared(self) -> bool:
        return self.node is not None


@dataclass(frozen=True)
class Layout:
    cu: tuple[int, ...]  # packed sequence boundaries (host copy)
    segments: tuple[Segment, ...]  # compact order
    compact_src: np.ndarray  # [C] packed row of each compact row
    expand_index: np.ndarray  # [T] compact row of each packed row

    @property
    def packed_length(self) -> int:
        return self.cu[-1]

    @property
    def compact_length(self) -> int:
        return len(self.compact_src)

    @property
    def depth(self) -> int:
        """Levels of shared nodes (1 for one-level sharing)."""
        return 1 + max((s.level for s in self.segments if s.shared), default=-1)

    def path(self, index: int) -> list[Segment]:
        """The segments from the root down to `index` (inclusive)."""
        out = []
        while index >= 0:
            seg = self.segments[index]
            out.append(seg)
            index = seg.parent
        return out[::-1]


def build_layout(nodes: list[Node], cu: list[int]) -> Layout:
    """Lay out the nodes (parents before children, as `find_tree` returns them) and every sequence."""
    kids: dict[int, list[int]] = {}
    root_of_first: dict[int, int] = {}
    deepest: dict[int, int] = {}  # sequence -> its deepest node
    for i, node in enumerate(nodes):
        if node.parent is None:
            root_of_first[node.members[0]] = i
        else:
            kids.setdefault(node.parent, []).append(i)
        for m in node.members:
            deepest[m] = i  # parents come first, so the last write is the deepest
    leaves_of: dict[int, list[int]] = {}
    for m, i in deepest.items():
        leaves_of.setdefault(i, []).append(m)

    segments: list[dict] = []
    pos = 0

    def add(length, offset, members, parent, level, node) -> int:
        nonlocal pos
        segments.append(
            {
                "start": pos,
                "length": length,
                "offset": offset,
                "members": members,
                "parent": parent,
                "level": level,
                "node": node,
                "children": [],
            }
        )
        pos += length
        if parent >= 0:
            segments[parent]["children"].append(len(segments) - 1)
        return len(segments) - 1

    def visit(i: int, parent: int, level: int) -> None:
        node = nodes[i]
        me = add(node.length, node.start, node.members, parent, level, i)
        # children (nested nodes and leaves) by first member
        entries = [(nodes[c].members[0], c) for c in kids.get(i, [])]
        entries += [(m, None) for m in leaves_of.get(i, [])]
        for first, child in sorted(entries):
            if child is None:
                add(cu[first + 1] - cu[first] - node.end, node.end, (first,), me, level + 1, None)
            else:
                visit(child, me, level + 1)

    in_node = set(deepest)
    for s in range(len(cu) - 1):
        if s in root_of_first:
            visit(root_of_first[s], -1, 0)
        elif s not in in_node:
            add(cu[s + 1] - cu[s], 0, (s,), -1, 0, None)

    segs = tuple(Segment(**{**d, "children": tuple(d["children"])}) for d in segments)
    src_starts = [cu[s.members[0]] + s.offset for s in segs]
    compact_src = ranges(src_starts, [s.length for s in segs])
    expand_index = np.empty(cu[-1], dtype=np.int64)
    expand_index[compact_src] = np.arange(len(compact_src), dtype=np.int64)
    f_packed, f_compact, f_len = [], [], []  # rows of every member but the source of a shared node
    for s in segs:
        if s.shared:
            for m in s.members[1:]:
                f_packed.append(cu[m] + s.offset)
                f_compact.append(s.start)
                f_len.append(s.length)
    if f_packed:
        expand_index[ranges(f_packed, f_len)] = ranges(f_compact, f_len)
    return Layout(tuple(cu), segs, compact_src, expand_index)
