"""Every index array of the plan pinned on three small trees (written out as runs of consecutive rows).

The arrays were recorded from the row-by-row builders before the plan build was vectorised
(issue 19, item 4); any change to the layout, the GDN rounds, the conv look-back, the attention
keys or the LM-row dedup shows up here as a named difference.
"""

import random

import numpy as np
import pytest
import torch
from patchgen.kernels.shared_prefix import build_plan, grouping
from patchgen.kernels.shared_prefix import plan as plan_module
from patchgen.kernels.shared_prefix.rows import Arena

from tests.models.prefix_trees import pack


def toks(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def runs(t):
    """An index array as `(first, count)` runs of consecutive values."""
    out = []
    for x in t.reshape(-1).tolist():
        if out and out[-1][0] + out[-1][1] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return [tuple(r) for r in out]


def describe(plan):
    rounds = [
        None
        if r is None
        else {
            "src": runs(r.src),
            "cu": r.cu_seqlens.tolist(),
            "chunks": [tuple(x) for x in r.chunk_indices.tolist()],
            "state": None if r.state_index is None else r.state_index.tolist(),
            "zero": r.zero_state,
            "export": r.export_state,
        }
        for r in plan.gdn.rounds
    ]
    a = plan.attention
    return {
        "nodes": [(n.members, n.start, n.end, n.parent) for n in plan.nodes],
        "compact_src": runs(plan.compact_src),
        "expand_index": runs(plan.expand_index),
        "cu_seqlens": plan.cu_seqlens.tolist(),
        "positions": runs(plan.position_ids[0]),
        "gdn_rounds": rounds,
        "gdn_out": runs(plan.gdn.out_index),
        "conv": {
            "src": runs(plan.conv.src),
            "cu": plan.conv.cu_seqlens.tolist(),
            "out": runs(plan.conv.out_index),
        },
        "attention": {
            "kv": runs(a.kv_src),
            "cu_q": a.cu_seqlens_q.tolist(),
            "cu_k": a.cu_seqlens_k.tolist(),
            "max": (a.max_seqlen_q, a.max_seqlen_k),
        },
        "lm": {
            "rows": runs(plan.lm.rows),
            "label_src": runs(plan.lm.label_src),
            "inverse": runs(plan.lm.inverse),
            "length": plan.lm.length,
        },
    }


P = toks(70, 1)
S, Q1, Q2 = toks(64, 6), toks(65, 7), toks(64, 8)
R, A, B = toks(100, 13), toks(64, 14), toks(70, 15)
TREES = {
    # one group with an unaligned 70-row prefix, a singleton and an empty sequence between members
    "one_level": ([P + toks(1, 2), toks(5, 3), P + toks(2, 4), [], P + toks(1, 5)], {}),
    # a 64-row system prompt, then two prompts of 65 (unaligned) and 64 (aligned) rows, two rollouts each
    "two_levels": (
        [S + Q1 + toks(2, 9), S + Q2 + toks(1, 10), S + Q1 + toks(3, 11), S + Q2 + toks(2, 12)],
        {"max_depth": 4, "level_cost": 0},
    ),
    # a spine: at every level one sequence branches off, the last node has two
    "three_levels": (
        [R + A + B + toks(1, 16), R + toks(2, 17), R + A + toks(1, 18), R + A + B + toks(2, 19)],
        {"max_depth": 4, "level_cost": 0},
    ),
}


ONE_LEVEL = {
    "nodes": [((0, 2, 4), 0, 70, None)],
    "compact_src": [(0, 71), (146, 2), (218, 1), (71, 5)],
    "expand_index": [(0, 71), (74, 5), (0, 70), (71, 2), (0, 70), (73, 1)],
    "cu_seqlens": [0, 74, 79, 79],
    "positions": [(0, 71), (70, 2), (70, 1), (0, 5)],
    "gdn_rounds": [
        {
            "src": [(0, 64), (74, 5)],
            "cu": [0, 64, 69],
            "chunks": [(0, 0), (1, 0)],
            "state": None,
            "zero": False,
            "export": True,
        },
        {
            "src": [(64, 6), (64, 7), (64, 6), (71, 2), (64, 6), (73, 1)],
            "cu": [0, 6, 13, 21, 28],
            "chunks": [(0, 0), (1, 0), (2, 0), (3, 0)],
            "state": [0, 0, 0, 0],
            "zero": False,
            "export": False,
        },
    ],
    "gdn_out": [(0, 64), (69, 6), (81, 1), (88, 2), (96, 1), (64, 5)],
    "conv": {
        "src": [(0, 70), (67, 4), (67, 3), (71, 2), (67, 3), (73, 6)],
        "cu": [0, 70, 74, 79, 83, 88],
        "out": [(0, 70), (73, 1), (77, 2), (82, 6)],
    },
    "attention": {
        "kv": [(0, 70), (0, 71), (0, 70), (71, 2), (0, 70), (73, 6)],
        "cu_q": [0, 70, 71, 73, 74, 79],
        "cu_k": [0, 70, 141, 213, 284, 289],
        "max": (70, 72),
    },
    "lm": {
        "rows": [(0, 79), (69, 1), (69, 1)],
        "label_src": [(0, 71), (146, 2), (218, 1), (71, 5), (145, 1), (217, 1)],
        "inverse": [(0, 71), (74, 5), (0, 69), (79, 1), (71, 2), (0, 69), (80, 1), (73, 1)],
        "length": 81,
    },
}
TWO_LEVELS = {
    "nodes": [((0, 1, 2, 3), 0, 64, None), ((0, 2), 64, 129, 0), ((1, 3), 64, 128, 0)],
    "compact_src": [(0, 131), (389, 3), (195, 65), (520, 2)],
    "expand_index": [(0, 131), (0, 64), (134, 65), (0, 129), (131, 3), (0, 64), (134, 64), (199, 2)],
    "cu_seqlens": [0, 201],
    "positions": [(0, 131), (129, 3), (64, 65), (128, 2)],
    "gdn_rounds": [
        {"src": [(0, 64)], "cu": [0, 64], "chunks": [(0, 0)], "state": None, "zero": False, "export": True},
        {
            "src": [(64, 64), (134, 64)],
            "cu": [0, 64, 128],
            "chunks": [(0, 0), (1, 0)],
            "state": [0, 0],
            "zero": False,
            "export": True,
        },
        {
            "src": [(128, 1), (128, 3), (128, 1), (131, 3), (198, 3)],
            "cu": [0, 1, 4, 8, 9, 11],
            "chunks": [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)],
            "state": [0, 0, 0, 1, 1],
            "zero": False,
            "export": False,
        },
    ],
    "gdn_out": [(0, 128), (192, 1), (194, 2), (197, 3), (128, 64), (200, 3)],
    "conv": {
        "src": [
            (0, 64),
            (61, 68),
            (126, 5),
            (126, 3),
            (131, 3),
            (61, 3),
            (134, 64),
            (195, 4),
            (195, 3),
            (199, 2),
        ],
        "cu": [0, 64, 132, 137, 143, 210, 214, 219],
        "out": [(0, 64), (67, 65), (135, 2), (140, 3), (146, 64), (213, 1), (217, 2)],
    },
    "attention": {
        "kv": [
            (0, 64),
            (0, 129),
            (0, 131),
            (0, 129),
            (131, 3),
            (0, 64),
            (134, 64),
            (0, 64),
            (134, 65),
            (0, 64),
            (134, 64),
            (199, 2),
        ],
        "cu_q": [0, 64, 129, 131, 134, 198, 199, 201],
        "cu_k": [0, 64, 193, 324, 456, 584, 713, 843],
        "max": (65, 132),
    },
    "lm": {
        "rows": [(0, 201), (63, 1), (128, 1), (197, 1)],
        "label_src": [(0, 131), (389, 3), (195, 65), (520, 2), (194, 1), (388, 1), (519, 1)],
        "inverse": [
            (0, 131),
            (0, 63),
            (201, 1),
            (134, 65),
            (0, 128),
            (202, 1),
            (131, 3),
            (0, 63),
            (201, 1),
            (134, 63),
            (203, 1),
            (199, 2),
        ],
        "length": 204,
    },
}
THREE_LEVELS = {
    "nodes": [((0, 1, 2, 3), 0, 100, None), ((0, 2, 3), 100, 164, 0), ((0, 3), 164, 234, 1)],
    "compact_src": [(0, 235), (736, 2), (501, 1), (335, 2)],
    "expand_index": [(0, 235), (0, 100), (238, 2), (0, 164), (237, 1), (0, 234), (235, 2)],
    "cu_seqlens": [0, 240],
    "positions": [(0, 235), (234, 2), (164, 1), (100, 2)],
    "gdn_rounds": [
        {"src": [(0, 64)], "cu": [0, 64], "chunks": [(0, 0)], "state": None, "zero": False, "export": True},
        {
            "src": [(64, 36), (64, 64), (64, 36), (238, 2)],
            "cu": [0, 36, 100, 138],
            "chunks": [(0, 0), (1, 0), (2, 0)],
            "state": [0, 0, 0],
            "zero": False,
            "export": True,
        },
        {
            "src": [(128, 36), (128, 64), (128, 36), (237, 1)],
            "cu": [0, 36, 100, 137],
            "chunks": [(0, 0), (1, 0), (2, 0)],
            "state": [1, 1, 1],
            "zero": False,
            "export": True,
        },
        {
            "src": [(192, 42), (192, 43), (192, 42), (235, 2)],
            "cu": [0, 42, 85, 129],
            "chunks": [(0, 0), (1, 0), (2, 0)],
            "state": [1, 1, 1],
            "zero": False,
            "export": False,
        },
    ],
    "gdn_out": [(0, 100), (136, 28), (202, 36), (274, 28), (339, 42), (423, 1), (466, 2), (338, 1), (200, 2)],
    "conv": {
        "src": [
            (0, 100),
            (97, 67),
            (161, 73),
            (231, 4),
            (231, 3),
            (235, 2),
            (161, 3),
            (237, 1),
            (97, 3),
            (238, 2),
        ],
        "cu": [0, 100, 167, 240, 244, 249, 253, 258],
        "out": [(0, 100), (103, 64), (170, 70), (243, 1), (247, 2), (252, 1), (256, 2)],
    },
    "attention": {
        "kv": [
            (0, 100),
            (0, 164),
            (0, 234),
            (0, 235),
            (0, 234),
            (235, 2),
            (0, 164),
            (237, 1),
            (0, 100),
            (238, 2),
        ],
        "cu_q": [0, 100, 164, 234, 235, 237, 238, 240],
        "cu_k": [0, 100, 264, 498, 733, 969, 1134, 1236],
        "max": (100, 236),
    },
    "lm": {
        "rows": [(0, 240), (99, 1), (163, 1), (233, 1)],
        "label_src": [(0, 235), (736, 2), (501, 1), (335, 2), (334, 1), (500, 1), (735, 1)],
        "inverse": [
            (0, 235),
            (0, 99),
            (240, 1),
            (238, 2),
            (0, 163),
            (241, 1),
            (237, 1),
            (0, 233),
            (242, 1),
            (235, 2),
        ],
        "length": 243,
    },
}


PINNED = {"one_level": ONE_LEVEL, "two_levels": TWO_LEVELS, "three_levels": THREE_LEVELS}


@pytest.mark.parametrize("tree", PINNED)
def test_every_index_array_of_the_plan_is_pinned(tree):
    seqs, options = TREES[tree]
    got = describe(build_plan(*pack(seqs), **options))
    for key, expected in PINNED[tree].items():
        assert got[key] == expected, key


@pytest.mark.parametrize("tree", PINNED)
def test_mrope_rows_pin_the_same_arrays_and_positions_on_every_row(tree):
    seqs, options = TREES[tree]
    ids, cu = pack(seqs)
    per_sequence = torch.cat([torch.arange(len(s)) for s in seqs]).reshape(1, -1)
    plan = build_plan(ids, cu, per_sequence.expand(3, -1).reshape(3, 1, -1).contiguous(), **options)
    assert plan.position_ids.shape == (3, 1, plan.compact_length)
    for row in plan.position_ids:
        assert runs(row[0]) == PINNED[tree]["positions"]
    got = describe(build_plan(ids, cu, **options))
    assert got["lm"] == PINNED[tree]["lm"] and got["gdn_rounds"] == PINNED[tree]["gdn_rounds"]


def test_upload_from_the_arena_copies_nothing_on_the_host():
    """Arrays written into the arena are uploaded as the arena itself: views, no packing copy."""
    arena = Arena(np.empty(64, dtype=np.int64))
    host = {
        "a": {"x": arena.ranges([5, 0], [3, 2]), "cu": arena.boundaries([2, 3])},
        "b": {"y": arena.put(np.ones((2, 3)))},
    }
    out = plan_module._upload(host, torch.device("cpu"), pack=True, arena=arena)
    assert out["a"]["x"].tolist() == [5, 6, 7, 0, 1] and out["a"]["cu"].tolist() == [0, 2, 5]
    assert out["a"]["cu"].dtype == torch.int32 and out["b"]["y"].shape == (2, 3)
    for name, key in (("a", "x"), ("a", "cu"), ("b", "y")):
        assert out[name][key].data_ptr() == host[name][key].ctypes.data  # the arena is the staging buffer
    assert len({t.untyped_storage().data_ptr() for d in out.values() for t in d.values()}) == 1


def test_an_array_that_does_not_fit_the_arena_is_packed_with_the_others():
    arena = Arena(np.empty(2, dtype=np.int64))
    inside, outside = arena.put([1, 2]), arena.put([3, 4, 5])
    assert arena.slot_of(inside) == 0 and arena.slot_of(outside) is None
    out = plan_module._upload({"a": {"i": inside, "o": outside}}, torch.device("cpu"), pack=True, arena=arena)
    assert out["a"]["i"].tolist() == [1, 2] and out["a"]["o"].tolist() == [3, 4, 5]
    assert out["a"]["o"].data_ptr() != outside.ctypes.data


def quadratic_best_partition(adjacent, min_prefix):
    """The naive O(m^2) scan of every last segment: the reference of `grouping._best_partition`."""
    m = len(adjacent) + 1
    best, choice = [0] * (m + 1), [(0, 0)] * (m + 1)
    for j in range(1, m + 1):
        best[j], choice[j] = best[j - 1], (j - 1, 0)
        prefix = None
        for i in range(j - 2, -1, -1):
            prefix = adjacent[i] if prefix is None else min(prefix, adjacent[i])
            if prefix < min_prefix:
                break
            if best[i] + (j - i - 1) * prefix > best[j]:
                best[j], choice[j] = best[i] + (j - i - 1) * prefix, (i, prefix)
    out, j = [], m
    while j > 0:
        i, prefix = choice[j]
        if j - i > 1:
            out.append((i, j, prefix))
        j = i
    return out[::-1]


@pytest.mark.parametrize("seed", range(4))
def test_grouping_dynamic_program_equals_the_quadratic_scan_ties_included(seed):
    rng = random.Random(seed)
    for _ in range(500):
        values = rng.choice([[0, 5, 64, 64, 65, 128, 200], [64, 64, 64, 128], list(range(60, 70))])
        adjacent = [rng.choice(values) for _ in range(rng.randint(0, 30))]
        min_prefix = rng.choice([1, 64, 65, 100])
        assert grouping._best_partition(adjacent, min_prefix) == quadratic_best_partition(
            adjacent, min_prefix
        )


@pytest.mark.parametrize("with_positions", [False, True])
def test_batched_common_prefixes_equal_the_pairwise_ones(monkeypatch, with_positions):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, 30)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, 3, cu[-1])  # a small vocabulary: long common prefixes
    positions = rng.integers(0, 2, (2, cu[-1])) if with_positions else None
    first, second = rng.integers(0, 30, 200), rng.integers(0, 30, 200)
    batched = grouping._common_prefixes(ids, positions, cu, first, second)
    monkeypatch.setattr(grouping, "PAIRWISE_MAX", 10**9)
    assert batched.tolist() == grouping._common_prefixes(ids, positions, cu, first, second).tolist()


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("tree", [False, True])
def test_every_index_array_of_a_plan_goes_up_in_one_copy_of_the_arena(monkeypatch, tree, padded):
    """Every device tensor of the plan is a view of one buffer (one host-to-device copy), and that
    buffer is the arena the builders wrote into (no packing copy on the host); a plan padded to bucket
    counts too (its padded arrays are built in the arena, not packed beside it)."""
    real = plan_module._upload
    monkeypatch.setattr(plan_module, "_upload", lambda host, device, arena=None: real(host, device, pack=True, arena=arena))
    rng = random.Random(4)
    system = [rng.randrange(1, 1000) for _ in range(70)]
    seqs = []
    for p in range(3):
        prompt = system + [rng.randrange(1, 1000) for _ in range(65 + p)]
        seqs += [prompt + [rng.randrange(1, 1000) for _ in range(1 + i)] for i in range(4)]
    seqs.append([rng.randrange(1, 1000) for _ in range(20)])
    ids, cu = pack(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs]).expand(3, -1).reshape(3, 1, -1) + 1
    plan = build_plan(ids, cu, positions, max_depth=4 if tree else 1, level_cost=0, pad_to_bucket=padded)
    assert plan.depth == (2 if tree else 1) and (plan.bucket is not None) == padded
    tensors = [plan.compact_src, plan.expand_index, plan.position_ids, plan.cu_seqlens, plan.gdn.out_index, plan.gdn.src]
    tensors += [t for r in plan.gdn.rounds if r is not None for t in (r.src, r.cu_seqlens, r.chunk_indices)]
    tensors += [plan.conv.segment_cu, plan.conv.segment_chunks, plan.conv.state_rows, plan.attention.kv_src]
    tensors += [plan.lm.rows, plan.lm.inverse] + ([plan.conv.extra_src] if padded else [plan.conv.src])
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert plan.expand_index.data_ptr() == plan.layout.expand_index.ctypes.data
