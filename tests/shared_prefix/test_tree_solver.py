"""The tree's trie and the collection of its kept nodes against their first, plainest form: one
call per child, leaves included (the fast form skips the calls that leaves answer with nothing).
Same tries, same kept nodes, on random trees, systems prompts and vocabularies that make ties."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from patchgen.kernels.shared_prefix import tree
from patchgen.kernels.shared_prefix.grouping import sorted_runs

from tests.models.prefix_trees import pack, prefix_trees

SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}


def reference_trie(seqs, adjacent):
    """The compressed trie, a call per child: children split where the adjacent prefix equals the node's."""

    def build(lo, hi):
        if hi - lo == 1:
            return lo
        prefix = min(adjacent[lo : hi - 1])
        children, first = [], lo
        for i in range(lo, hi - 1):
            if adjacent[i] == prefix:
                children.append(build(first, i + 1))
                first = i + 1
        children.append(build(first, hi))
        height = 1 + max(0 if isinstance(c, int) else c.height for c in children)
        return tree._TrieNode(seqs, lo, hi, prefix, children, height)

    return build(0, len(seqs))


class ReferenceSolver(tree._Solver):
    def _solve(self, node, above):
        """Rows saved and children kept per depth, each depth a call of the plain `_split`."""
        if isinstance(node, int):
            return self.none
        key = (id(node), above)
        if key in self.memo:
            return self.memo[key]
        top, children, length = self.max_depth, node.children, node.prefix - above
        if node.height == 1:
            if length < self._shortest(above):
                result = self.none
            else:
                every = list(range(len(children)))
                result = ([0] + [(node.hi - node.lo - 1) * length] * top, [[]] + [every] * top)
            self.memo[key] = result
            return result
        alone = [self._values(c, above) for c in children]
        values, joined_at = [0] * (top + 1), [[] for _ in range(top + 1)]
        if length < self._shortest(above):
            for d in range(1, top + 1):
                values[d] = sum(0 if a is None else a[d] for a in alone)
        else:
            kept = [self._values(c, node.prefix) for c in children]
            sizes = [1 if isinstance(c, int) else c.hi - c.lo for c in children]
            for d in range(1, top + 1):
                values[d], joined_at[d] = self._split(
                    [0 if a is None else a[d] for a in alone],
                    [0 if a is None else a[d - 1] for a in kept],
                    sizes,
                    length,
                )
        self.memo[key] = (values, joined_at)
        return values, joined_at

    def collect(self, node, above, depth, parent, out):
        """Every child visited, leaves too; a node with only leaves below asks for all of them."""
        if isinstance(node, int) or depth == 0:
            return
        children = node.children
        if node.height == 1:
            joined = list(range(len(children))) if node.prefix - above >= self._shortest(above) else []
        else:
            joined = self._solve(node, above)[1][depth]
        if joined:
            members = []
            for c in joined:
                child = children[c]
                members += [node.seqs[child]] if isinstance(child, int) else node.seqs[child.lo : child.hi]
            slot = len(out)
            out.append((tuple(sorted(members)), above, node.prefix, parent))
            for c in joined:
                self.collect(children[c], node.prefix, depth - 1, slot, out)
        chosen = set(joined)
        for ci, c in enumerate(children):
            if ci not in chosen:
                self.collect(c, above, depth, parent, out)


def trie_shape(node):
    if isinstance(node, int):
        return node
    return (node.lo, node.hi, node.prefix, node.height, [trie_shape(c) for c in node.children])


def nodes(found):
    return [(n.members, n.start, n.end, n.parent) for n in found]


@settings(max_examples=80, **SETTINGS)
@given(
    st.one_of(prefix_trees(), prefix_trees(depth=(2, 4), vocab=3)), st.sampled_from([16, 64]), st.sampled_from([0, 64, 300])
)
def test_tries_and_kept_nodes_equal_the_plain_forms(monkeypatch, batch, min_prefix, level_cost):
    seqs, _, positions = batch
    ids, cu = pack(seqs)
    ids = ids.reshape(-1).numpy()
    cu = cu.tolist()
    rows = None if positions is None else positions.reshape(-1, ids.shape[0]).numpy()
    for order, adjacent in sorted_runs(ids, rows, cu, min_prefix):
        assert trie_shape(tree._trie(order, adjacent)) == trie_shape(reference_trie(order, adjacent))
    for depth in (2, 3, 4):
        options = {"min_prefix": min_prefix, "max_depth": depth, "nested_min": 64, "level_cost": level_cost}
        fast = nodes(tree.find_tree(ids, rows, cu, **options))
        with monkeypatch.context() as patched:
            patched.setattr(tree, "_trie", reference_trie)
            patched.setattr(tree, "_Solver", ReferenceSolver)
            assert nodes(tree.find_tree(ids, rows, cu, **options)) == fast


def test_a_two_level_trie_keeps_its_leaves_as_ints():
    # two groups of two under one root: prefix 5 between the groups, 9 inside them
    trie = tree._trie([3, 1, 0, 2], [9, 5, 9])
    assert trie_shape(trie) == (0, 4, 5, 2, [(0, 2, 9, 1, [0, 1]), (2, 4, 9, 1, [2, 3])])
    assert np.array_equal([c.lo for c in trie.children], [0, 2])
