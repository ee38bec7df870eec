"""The fast plan builder against the naive one, field by field, on random trees and one-level batches.

The naive builder: the grouping's runs from the byte order of every sequence's `(id, *position
rows)` symbols and their common prefixes counted symbol by symbol (`reference_runs`), the one-level
split by the quadratic scan, the trie and its solver in their plain forms (`test_tree_solver`), and
every index array from its definition, a loop per segment (`plan_reference.py`).
"""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from patchgen.kernels.shared_prefix import build_plan, grouping, tree
from patchgen.kernels.shared_prefix.aligned import align_to_chunks

from tests.models.prefix_trees import pack, prefix_trees
from tests.shared_prefix.plan_reference import plan_arrays, reference_arrays
from tests.shared_prefix.test_plan_arrays import quadratic_best_partition
from tests.shared_prefix.test_plan_positions import reference_runs
from tests.shared_prefix.test_tree_solver import ReferenceSolver, reference_trie

SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}
POSITIONS = ["none", "per_sequence", "mrope", "shifted", "stepped", "constants", "diverging"]


def position_rows(seqs, mode, rng):
    """`[R, 1, T]` / `[1, T]` positions of a kind, or None."""
    local = [np.arange(len(s)) for s in seqs]
    flat = np.concatenate(local).astype(np.int64) if seqs else np.zeros(0, np.int64)
    if mode == "none":
        return None
    if mode == "per_sequence":
        return torch.from_numpy(flat).reshape(1, -1)
    rows = np.stack([flat] * 3)
    if mode in ("shifted", "stepped"):  # plan_build.py's [3,1,T]* and [3,1,T]~
        rows[1] += 1
    if mode == "stepped":
        rows[2] += (flat % 4 == 0).astype(np.int64)
    if mode == "constants":  # a constant per sequence: only sequences with equal constants share
        rows[1] += np.repeat([int(rng.choice([0, 0, 3])) for _ in seqs], [len(s) for s in seqs]).astype(np.int64)
    if mode == "diverging" and len(flat):  # one row steps away inside some sequence
        rows[2, int(rng.integers(len(flat))) :] += 1
    return torch.from_numpy(rows).reshape(3, 1, -1)


def naive_nodes(monkeypatch, seqs, rows, **options):
    """The tree's nodes from the naive grouping, split and solver."""
    min_prefix = options["min_prefix"]
    ids, cu = pack(seqs)
    ids = ids.reshape(-1).numpy()
    symbol_rows = np.zeros((0, len(ids)), np.int64) if rows is None else rows
    with monkeypatch.context() as patched:
        patched.setattr(tree, "sorted_runs", lambda *args: reference_runs(seqs, symbol_rows, min_prefix))
        patched.setattr(grouping, "_best_partition", quadratic_best_partition)
        patched.setattr(tree, "_trie", reference_trie)
        patched.setattr(tree, "_Solver", ReferenceSolver)
        nodes = tree.find_tree(
            ids,
            rows,
            cu.tolist(),
            min_prefix=min_prefix,
            max_depth=options["max_depth"],
            nested_min=max(64, options["conv_kernel_size"] - 1),
            level_cost=options["level_cost"],
        )
    if options["chunk_aligned"]:
        nodes = align_to_chunks(nodes, min_prefix, max(64, options["conv_kernel_size"] - 1))
    return nodes


@settings(max_examples=120, **SETTINGS)
@given(
    st.one_of(
        prefix_trees(depth=(2, 4), spine=True),
        prefix_trees(),
        prefix_trees(depth=(2, 4), vocab=3),
        prefix_trees(depth=(1, 1)),
    ),
    st.sampled_from(POSITIONS),
    st.sampled_from([1, 2, 4, 4]),
    st.sampled_from([0, 0, 256]),
    st.sampled_from([(64, 4, False), (16, 4, False), (64, 4, True), (64, 6, False)]),
    st.integers(0, 2**32 - 1),
)
def test_the_fast_plan_equals_the_naive_one_field_by_field(monkeypatch, batch, mode, depth, level_cost, shape, seed):
    seqs, prompt_lengths, _ = batch
    min_prefix, conv_kernel_size, chunk_aligned = shape
    positions = position_rows(seqs, mode, np.random.default_rng(seed))
    options = {
        "min_prefix": min_prefix,
        "max_depth": depth,
        "level_cost": level_cost,
        "conv_kernel_size": conv_kernel_size,
        "chunk_aligned": chunk_aligned,
    }
    assert_matches_naive(monkeypatch, seqs, prompt_lengths, positions, options)


def test_roots_shorter_than_a_chunk_start_their_rounds_from_zero_beside_others(monkeypatch):
    """A root under 64 rows exports no state (its round reads zeros), another root does: the state
    rows of one round mix both."""
    rng = np.random.default_rng(3)

    def toks(n):
        return rng.integers(1, 1000, n).tolist()

    short, long = toks(30), toks(100)
    seqs = [short + toks(2) for _ in range(3)] + [long + toks(3) for _ in range(3)] + [toks(70)]
    options = {"min_prefix": 16, "max_depth": 1, "level_cost": 0, "conv_kernel_size": 4, "chunk_aligned": False}
    plan = assert_matches_naive(monkeypatch, seqs, [30] * 3 + [100] * 3 + [0], None, options)
    assert plan.gdn.rounds[1].zero_state and plan.gdn.rounds[1].state_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def assert_matches_naive(monkeypatch, seqs, prompt_lengths, positions, options):
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, positions, **options)
    rows = None if positions is None else positions.reshape(-1, ids.shape[1]).numpy()
    nodes = naive_nodes(monkeypatch, seqs, rows, **options)
    if plan is None:
        assert nodes == []
        return plan
    assert [(n.members, n.start, n.end, n.parent) for n in plan.nodes] == [
        (n.members, n.start, n.end, n.parent) for n in nodes
    ]
    expected = reference_arrays(
        nodes, cu.tolist(), None if rows is None else rows.tolist(), options["conv_kernel_size"], options["chunk_aligned"]
    )
    got = plan_arrays(plan)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == expected[key], key

    # LM rows for prompts masked (-100) and labelled: each entry scores the largest label of its positions
    masked = ids.clone()
    for s, n in enumerate(prompt_lengths):
        masked[0, int(cu[s]) : int(cu[s]) + n] = -100
    for shift_labels in (ids, masked):
        lm = plan.lm_rows(shift_labels)
        best = {}
        for p, e in enumerate(expected["lm.inverse"]):
            best[e] = max(best.get(e, -(2**63)), int(shift_labels[0, p]))
        assert lm.labels.tolist() == [best[e] for e in range(expected["lm.length"])]
    return plan
