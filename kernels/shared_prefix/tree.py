"""The prefix tree: which sequences share which prefix, at every level.

Host code over numpy arrays. A `Node` is a run of rows that several sequences hold identically
(token ids and every position row) at the same offsets; nested nodes continue their parent.
Every sequence is a root-to-leaf path: the nodes it belongs to, then its own remainder (at least
one row). With `max_depth=1` the tree is the one-level grouping of `grouping.find_groups`.

Deeper trees come from the compressed trie of each bucket (lexicographic order, adjacent common
prefixes, the Cartesian tree of those) and a dynamic program that keeps the nodes which save the
most rows: `(members - 1) * length` per kept node, plus `level_cost` rows charged per level, since
every level costs one more GDN call per layer. A nested node must be at least `nested_min` rows
long (the GDN chunk, so that its children start from a state exported at a chunk boundary inside
it, and the conv look-back); a shorter one is merged into its children.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .grouping import group_runs, sorted_runs

MAX_TRIE_HEIGHT = 64  # deeper tries (chains of nested prefixes) keep the one-level plan


@dataclass(frozen=True)
class Node:
    """Rows `[start, end)` of every member sequence, shared; `parent` indexes `Plan.nodes` (None: a root)."""

    members: tuple[int, ...]  # packed sequence indices, ascending
    start: int  # offset inside each member of the node's first row (the parent's end)
    end: int
    parent: int | None

    @property
    def length(self) -> int:
        return self.end - self.start


def _node(members: tuple[int, ...], start: int, end: int, parent: int | None) -> Node:
    """`Node(members, start, end, parent)` without the frozen dataclass's checked `__setattr__` per
    field: a plan of hundreds of groups makes as many nodes, each of which cost a microsecond so."""
    node = object.__new__(Node)
    node.__dict__.update(members=members, start=start, end=end, parent=parent)
    return node


def find_tree(
    ids: np.ndarray,
    positions: np.ndarray | None,
    cu: list[int],
    *,
    min_prefix: int = 64,
    max_depth: int = 1,
    nested_min: int = 64,
    level_cost: int = 0,
) -> list[Node]:
    """Shared nodes of the packed row, parents before children, roots in packed order of their first member.

    `ids [T]`, `positions [R, T]` or None (per-sequence positions), `cu` the boundaries. A root is at
    least `min_prefix` rows long, a nested node at least `nested_min`; at most `max_depth` levels.
    """
    runs = sorted_runs(ids, positions, cu, min_prefix)
    groups, nests = group_runs(runs, min_prefix)
    # a run nests (its trie has an internal node below the root) exactly when its adjacent
    # prefixes are not all equal: where nothing nests, a deeper tree has nothing more to share
    if max_depth == 1 or not groups or not nests:
        return _flat(groups)
    limit = sys.getrecursionlimit()
    # the solver recurses once (a few frames) per trie level; a chain of nested
    # prefixes can be as deep as a bucket has sequences
    sys.setrecursionlimit(max(limit, 4 * len(cu) + 1000))
    try:
        tries = [_trie(order, adjacent) for order, adjacent in runs]
        if max(t.height for t in tries) > MAX_TRIE_HEIGHT:
            return _flat(groups)  # a long chain of nested prefixes (not an RL batch): the solver would be quadratic in it
        flat_saved = sum((len(members) - 1) * prefix for members, prefix in groups)
        solver = _Solver(min_prefix, max(nested_min, min_prefix), max_depth)
        # depth 1 is the one-level grouping (exactly today's plan); deeper only where it pays its levels
        best_depth, best_cost = 1, -flat_saved + level_cost
        for depth in range(2, max_depth + 1):
            cost = -sum(solver.best(t, 0, depth) for t in tries) + level_cost * depth
            if cost < best_cost:
                best_depth, best_cost = depth, cost
        if best_depth == 1:
            return _flat(groups)
        kept: list[tuple[tuple[int, ...], int, int, int | None]] = []  # (members, start, end, parent)
        for t in tries:
            solver.collect(t, 0, best_depth, None, kept)
    finally:
        sys.setrecursionlimit(limit)
    return _ordered(kept)


def _flat(groups: list[tuple[tuple[int, ...], int]]) -> list[Node]:
    """The one-level plan's nodes: one root per group of `group_runs`."""
    return [_node(members, 0, prefix, None) for members, prefix in groups]


@dataclass(eq=False, slots=True)
class _TrieNode:
    """An internal node: an interval `[lo, hi)` of a bucket's sorted sequences and their common prefix.

    Children are internal nodes or leaves; a leaf is a plain int, its position in the sorted order
    (few objects per trie: its build allocates little for the garbage collector to track).
    """

    seqs: list[int]  # the bucket's sequences in lexicographic order (shared by every node of the trie)
    lo: int
    hi: int
    prefix: int  # common prefix of the members (capped so every member keeps a row)
    children: list[_TrieNode | int]
    height: int  # levels of internal nodes from here down: more depth than that changes nothing


def _trie(seqs: list[int], adjacent: list[int]) -> _TrieNode:
    """The compressed trie of sequences in lexicographic order, from their adjacent common prefixes.

    A node is an interval whose common prefix is the minimum of its adjacent prefixes; its children
    split where an adjacent prefix equals it. Built in one pass (a stack of the open nodes, prefixes
    rising towards the top; the last finished subtree waits to be attached): no call per node.
    """
    stack: list[list] = []  # open nodes: [prefix, lo, children, height]
    done: _TrieNode | int = 0  # the last finished subtree (a leaf is its position)
    for i, a in enumerate(adjacent):
        while stack and stack[-1][0] > a:  # the open nodes deeper than this pair end at item i
            done = _close(seqs, stack.pop(), done, i + 1)
        if stack and stack[-1][0] == a:
            top = stack[-1]
            top[2].append(done)
            if not isinstance(done, int) and done.height + 1 > top[3]:
                top[3] = done.height + 1
        else:
            lo = done if isinstance(done, int) else done.lo
            stack.append([a, lo, [done], 1 if isinstance(done, int) else done.height + 1])
        done = i + 1
    while stack:
        done = _close(seqs, stack.pop(), done, len(adjacent) + 1)
    return done


def _close(seqs: list[int], node: list, last: _TrieNode | int, hi: int) -> _TrieNode:
    """An open node of `_trie`, finished with its last child."""
    prefix, lo, children, height = node
    children.append(last)
    if not isinstance(last, int) and last.height + 1 > height:
        height = last.height + 1
    return _TrieNode(seqs, lo, hi, prefix, children, height)


class _Solver:
    """Most rows saved under a trie node, given the end of the nearest kept ancestor, for every
    number of levels left at once (`0 .. max_depth`: one pass over the trie serves every depth).

    At a trie node with prefix `p`, any set of its children holding two or more sequences may become
    one kept node of rows `[above, p)`, the other children solved on their own. One node is the most
    there is to keep: two nodes of the same rows save `length` fewer rows than one node of both
    member sets. So the best set is every child whose gain from joining, `members * length + kept -
    alone`, is positive, kept when the total (less the `length` that a node's first member does not
    save) is positive: O(k) per depth for `k` children.
    """

    def __init__(self, min_root: int, min_nested: int, max_depth: int):
        self.min_root, self.min_nested, self.max_depth = min_root, min_nested, max_depth
        self.memo: dict[tuple[int, int], tuple[list[int], list[list]]] = {}
        self.none = ([0] * (max_depth + 1), [[] for _ in range(max_depth + 1)])
        self.flats: dict[int, list[int]] = {}

    def _shortest(self, above: int) -> int:
        return self.min_root if above == 0 else self.min_nested

    def _values(self, child: _TrieNode | int, above: int) -> list[int] | None:
        """Rows saved under `child` for every depth, None for nothing; a node with only leaves
        below keeps them all together at any depth, which needs no search (nor a memo entry)."""
        if isinstance(child, int):
            return None
        if child.height == 1:
            length = child.prefix - above
            if length < self._shortest(above):
                return None
            saved = (child.hi - child.lo - 1) * length
            flat = self.flats.get(saved)
            if flat is None:
                flat = self.flats[saved] = [0] + [saved] * self.max_depth
            return flat
        return self._solve(child, above)[0]

    def best(self, node: _TrieNode, above: int, depth: int) -> int:
        return self._solve(node, above)[0][depth]

    def _solve(self, node: _TrieNode | int, above: int) -> tuple[list[int], list[list]]:
        """(rows saved, the children kept together at the node) for every depth; more depth than the node's height changes nothing."""
        if isinstance(node, int):
            return self.none
        key = (id(node), above)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        top = self.max_depth
        children = node.children
        length = node.prefix - above
        if node.height == 1:  # only leaves below: keeping all of them together is best at any depth
            if length < self._shortest(above):
                result = self.none
            else:
                every = list(range(len(children)))
                result = ([0] + [(node.hi - node.lo - 1) * length] * top, [[]] + [every] * top)
            self.memo[key] = result
            return result
        zeros = self.none[0]
        values_of = self._values
        alone = []
        for c in children:
            a = values_of(c, above)
            alone.append(zeros if a is None else a)
        values, joined_at = [0] * (top + 1), [[] for _ in range(top + 1)]
        if length < self._shortest(above):
            for d in range(1, top + 1):
                values[d] = sum(a[d] for a in alone)
        else:
            prefix = node.prefix
            kept, sizes = [], []
            for c in children:
                k = values_of(c, prefix)
                kept.append(zeros if k is None else k)
                sizes.append(length if isinstance(c, int) else (c.hi - c.lo) * length)
            indices = range(len(children))
            for d in range(1, min(top, node.height) + 1):
                # `_split` of this depth's values, in one pass over the children
                saved_alone = total = members = 0
                joined = []
                for c in indices:
                    a = alone[c][d]
                    saved_alone += a
                    gain = sizes[c] + kept[c][d - 1] - a
                    if gain > 0:
                        joined.append(c)
                        total += gain
                        members += sizes[c]
                total -= length
                # members >= 2 sequences: sizes count `length` rows per sequence (length > 0 here)
                if total > 0 and members >= 2 * length:
                    values[d], joined_at[d] = saved_alone + total, joined
                else:
                    values[d] = saved_alone
            for d in range(node.height + 1, top + 1):
                values[d], joined_at[d] = values[node.height], joined_at[node.height]
        result = (values, joined_at)
        self.memo[key] = result
        return result

    @staticmethod
    def _split(alone: list[int], kept: list[int], sizes: list[int], length: int) -> tuple[int, list[int]]:
        """(rows saved, the children kept together at this node): every child that gains by joining, if
        that pays. The plain form of the pass inside `_solve` (the tests solve with this one too)."""
        gains = [size * length + k - a for size, k, a in zip(sizes, kept, alone)]
        joined = [c for c, gain in enumerate(gains) if gain > 0]
        total = sum(gains[c] for c in joined) - length
        if total > 0 and sum(sizes[c] for c in joined) >= 2:
            return sum(alone) + total, joined
        return sum(alone), []

    def collect(self, node: _TrieNode | int, above: int, depth: int, parent, out: list) -> None:
        """Append the kept nodes of the best solution as (members, start, end, parent slot)."""
        if isinstance(node, int) or depth == 0:
            return
        children = node.children
        if node.height == 1:  # only leaves below: all of them together, or nothing kept here
            if node.prefix - above >= self._shortest(above):
                out.append((tuple(sorted(node.seqs[node.lo : node.hi])), above, node.prefix, parent))
            return
        joined = self._solve(node, above)[1][depth]
        if joined:
            members = []
            for c in joined:
                child = children[c]
                members += [node.seqs[child]] if isinstance(child, int) else node.seqs[child.lo : child.hi]
            slot = len(out)
            out.append((tuple(sorted(members)), above, node.prefix, parent))
            for c in joined:
                if not isinstance(children[c], int):  # a leaf keeps nothing below it
                    self.collect(children[c], node.prefix, depth - 1, slot, out)
        chosen = set(joined)
        for ci, c in enumerate(children):
            if ci not in chosen and not isinstance(c, int):
                self.collect(c, above, depth, parent, out)


def _ordered(kept: list[tuple[tuple[int, ...], int, int, int | None]]) -> list[Node]:
    """Nodes in compact-row order (depth first, siblings by first member); parents renumbered.

    `kept` holds parents before children, so each node's key, the first members along its path
    from the root, is its parent's plus its own: one sort of those keys is the depth-first order
    (a parent's key is a prefix of its children's, siblings differ in their own first member)."""
    keys: list[tuple[int, ...]] = []
    for members, _, _, parent in kept:
        keys.append((members[0],) if parent is None else (*keys[parent], members[0]))
    order = sorted(range(len(kept)), key=keys.__getitem__)
    index = [0] * len(kept)
    for i, slot in enumerate(order):
        index[slot] = i
    nodes: list[Node] = []
    for slot in order:
        members, start, end, parent = kept[slot]
        nodes.append(_node(members, start, end, None if parent is None else index[parent]))
    return nodes
