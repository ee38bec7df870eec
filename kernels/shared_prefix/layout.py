"""The compact row: where every node of the prefix tree, every leaf and every singleton land.

Host code. Depth first from each root: `[node | child subtrees...]`, children ordered by their
first member, where a child is a nested node or a member's own remainder (a leaf); sequences in no
node stay whole (singletons); roots and singletons in packed order. With one level this is
`[prefix | suffix_1 | ... | suffix_n]` per group. Level by level (`by_level`, for chunk-aligned
plans), the roots and singletons come first, then every level-1 segment, and so on. Everything the mixers index is derived from
this one description (one numpy array per segment field), so they cannot disagree about the
layout; the builders work on whole arrays, never row by row or member by member.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .rows import Arena, boundaries, ranges
from .tree import Node

__all__ = ["Layout", "Segment", "boundaries", "build_layout", "ranges"]


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


@dataclass(frozen=True, eq=False)
class Layout:
    """Segments in compact order, one int64 array per field (`S` segments)."""

    cu: tuple[int, ...]  # packed sequence boundaries (host copy)
    start: np.ndarray  # [S] compact row of each segment's first row
    length: np.ndarray  # [S] rows (0 only for a zero-length singleton)
    offset: np.ndarray  # [S] offset inside its sequences of its first row
    source: np.ndarray  # [S] packed sequence whose rows the segment holds (a node's first member)
    parent: np.ndarray  # [S] parent segment, -1 for roots and singletons
    level: np.ndarray  # [S] 0 for roots and singletons
    node: np.ndarray  # [S] index into the plan's nodes, -1 for a leaf or a singleton
    ancestry: np.ndarray  # [S, levels] segments from the root down to each one (itself at its level), -1 after
    sequence_segment: np.ndarray  # [N] each sequence's own segment (its leaf, or itself as a singleton)
    nodes: tuple[Node, ...]
    compact_src: np.ndarray  # [C] packed row of each compact row
    expand_index: np.ndarray  # [T] compact row of each packed row

    @property
    def packed_length(self) -> int:
        return self.cu[-1]

    @property
    def compact_length(self) -> int:
        return len(self.compact_src)

    @functools.cached_property
    def cu_array(self) -> np.ndarray:
        """The packed sequence boundaries as an int64 array (`build_layout` hands over its own)."""
        return np.asarray(self.cu, dtype=np.int64)

    @property
    def end(self) -> np.ndarray:
        """[S] offset inside its sequences just past each segment's last row."""
        return self.offset + self.length

    @property
    def shared(self) -> np.ndarray:
        return self.node >= 0

    @property
    def depth(self) -> int:
        """Levels of shared nodes (1 for one-level sharing)."""
        shared = self.level[self.node >= 0]
        return 1 + int(shared.max()) if shared.size else 0

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        """The same layout as one `Segment` per run of rows (for reading and debugging)."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(self.parent.tolist()):
            if p >= 0:
                children.setdefault(p, []).append(i)
        return tuple(
            Segment(
                start=int(self.start[i]),
                length=int(self.length[i]),
                offset=int(self.offset[i]),
                members=self.nodes[n].members if n >= 0 else (int(self.source[i]),),
                parent=int(self.parent[i]),
                level=int(self.level[i]),
                node=n if n >= 0 else None,
                children=tuple(children.get(i, ())),
            )
            for i, n in enumerate(self.node.tolist())
        )

    def path(self, index: int) -> list[Segment]:
        """The segments from the root down to `index` (inclusive)."""
        return [self.segments[i] for i in self.ancestry[index].tolist() if i >= 0]


def build_layout(
    nodes: list[Node], cu: list[int], arena: Arena | None = None, by_level: bool = False, cu_array=None
) -> Layout:
    """Lay out the nodes (parents before children, as `find_tree` returns them) and every sequence;
    `compact_src` and `expand_index` are written into `arena` when given.

    `by_level`: every root and singleton first, then every level-1 segment, and so on (each level
    in the depth-first order), instead of each root followed by its subtree: the order of the GDN
    rounds, which then read the row in place when no node has a tail (`aligned.py`). `cu_array`: the
    same boundaries as a numpy array, when the caller has them."""
    arena = arena or Arena()
    cu_arr = np.asarray(cu if cu_array is None else cu_array, dtype=np.int64)
    n_seq, n_nodes = len(cu) - 1, len(nodes)
    # one pass over the nodes (parents come first, so a node's level follows its parent's)
    parents, starts, ends, sizes, levels_of, flat = [], [], [], [], [], []
    for n in nodes:
        p = -1 if n.parent is None else n.parent
        parents.append(p)
        starts.append(n.start)
        ends.append(n.end)
        sizes.append(len(n.members))
        levels_of.append(0 if p < 0 else levels_of[p] + 1)
        flat += n.members
    node_parent = np.array(parents, dtype=np.int64)
    node_start = np.array(starts, dtype=np.int64)
    node_end = np.array(ends, dtype=np.int64)
    node_level = np.array(levels_of, dtype=np.int64)
    sizes = np.array(sizes, dtype=np.int64)
    flat_members = np.array(flat, dtype=np.int64)
    member_node = np.arange(n_nodes, dtype=np.int64).repeat(sizes)
    node_first = flat_members[sizes.cumsum() - sizes]
    deepest = np.full(n_seq, -1, dtype=np.int64)  # each sequence's deepest node (children follow parents)
    np.maximum.at(deepest, flat_members, member_node)

    # unsorted segments: the nodes, then one per sequence (its leaf under its deepest node, or itself)
    seq = np.arange(n_seq, dtype=np.int64)
    in_node = deepest >= 0
    under = np.where(in_node, deepest, 0)
    seq_len = cu_arr[1:] - cu_arr[:-1]
    seq_offset = np.where(in_node, node_end[under] if n_nodes else 0, 0)
    u_length = np.concatenate([node_end - node_start, seq_len - seq_offset])
    u_offset = np.concatenate([node_start, seq_offset])
    u_source = np.concatenate([node_first, seq])
    u_node = np.concatenate([np.arange(n_nodes, dtype=np.int64), np.full(n_seq, -1, dtype=np.int64)])
    u_parent = np.concatenate([node_parent, np.where(in_node, deepest, -1)])  # in node numbering
    u_level = np.concatenate([node_level, np.where(in_node, node_level[under] + 1 if n_nodes else 0, 0)])

    # compact order: sort by the first members along the path from the root (a node's key is a
    # prefix of its descendants', -1 padding sorts it first); that is depth first, siblings by
    # first member, roots and singletons in packed order
    levels = int(u_level.max()) + 1 if u_level.size else 1
    n_seg = len(u_length)
    key = np.full((n_seg, levels), -1, dtype=np.int64)
    rows = np.arange(n_seg, dtype=np.int64)
    key[rows, u_level] = u_source
    up = u_parent.copy()
    for _ in range(levels - 1):
        has = up >= 0
        key[rows[has], node_level[up[has]]] = node_first[up[has]]
        up[has] = node_parent[up[has]]
    order = np.lexsort((*key.T[::-1], u_level) if by_level else key.T[::-1])
    seg_of = np.empty(n_seg, dtype=np.int64)
    seg_of[order] = np.arange(n_seg, dtype=np.int64)
    # unsorted index of each node is the node index, so a parent node's segment is seg_of[node]
    length, offset, source = u_length[order], u_offset[order], u_source[order]
    level, node = u_level[order], u_node[order]
    parent = u_parent[order]
    parent = np.where(parent >= 0, seg_of[np.maximum(parent, 0)], -1)
    start = length.cumsum() - length
    ancestry = _ancestry(parent, level, levels)

    compact_src = arena.ranges(cu_arr[source] + offset, length)
    # each sequence, in packed order, is the rows of the segments on its path from the root
    sequence_segment = seg_of[n_nodes:]
    path = ancestry[sequence_segment]
    path = path[path >= 0]
    expand_index = arena.ranges(start[path], length[path])
    layout = Layout(
        cu=tuple(cu),
        start=start,
        length=length,
        offset=offset,
        source=source,
        parent=parent,
        level=level,
        node=node,
        ancestry=ancestry,
        sequence_segment=sequence_segment,
        nodes=tuple(nodes),
        compact_src=compact_src,
        expand_index=expand_index,
    )
    layout.__dict__["cu_array"] = cu_arr  # the cached property, filled with the array at hand
    return layout


def _ancestry(parent: np.ndarray, level: np.ndarray, levels: int) -> np.ndarray:
    """[S, levels]: column `l` holds the ancestor at level `l` (the segment itself at its own level)."""
    out = np.full((len(parent), levels), -1, dtype=np.int64)
    rows = np.arange(len(parent), dtype=np.int64)
    cur = rows.copy()
    for _ in range(levels):
        has = cur >= 0
        out[rows[has], level[cur[has]]] = cur[has]
        cur[has] = parent[cur[has]]
    return out
