"""The chunk-aligned plan (`build_plan(..., chunk_aligned=True)`): whole chunks shared, level-by-level row."""

import torch
from patchgen.kernels.shared_prefix import build_plan

from tests.models.prefix_trees import pack


def _group(prompt, suffixes, first=0):
    return [list(range(first, first + prompt)) + [1000 + 10 * i + j for j in range(n)] for i, n in enumerate(suffixes)]


def test_prefixes_are_cut_back_to_whole_chunks():
    ids, cu = pack(_group(130, [5, 9, 3]))
    plan = build_plan(ids, cu, chunk_aligned=True)
    assert [(n.start, n.end) for n in plan.nodes] == [(0, 128)]
    assert plan.compact_length == ids.shape[1] - (3 - 1) * 128  # each member computes its 2 tail rows


def test_the_row_is_laid_out_level_by_level_and_the_rounds_read_it_in_place():
    seqs = _group(128, [5, 9]) + [list(range(700, 740))] + _group(100, [4, 4], first=500)
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, chunk_aligned=True)
    # roots and the singleton first, in packed order, then every leaf
    assert plan.cu_seqlens.tolist() == [0, 128, 168, 232, 237, 246, 286, 326]
    assert plan.gdn.src_identity and plan.gdn.out_identity
    assert not build_plan(ids, cu).gdn.src_identity  # the default plan gathers (tails, depth-first order)


def test_compact_and_expand_round_trip():
    seqs = _group(128, [5, 9]) + [list(range(700, 740))] + _group(100, [4, 4], first=500)
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, chunk_aligned=True)
    x = torch.arange(ids.shape[1], dtype=torch.float64).reshape(1, -1)
    shared = ids.reshape(-1)[plan.compact_src].reshape(1, -1)
    assert torch.equal(plan.expand(shared), ids)  # every packed row reads a compact row holding its token
    assert plan.compact(x).shape[1] == plan.compact_length


def test_a_root_shorter_than_a_chunk_after_the_cut_is_not_shared():
    ids, cu = pack(_group(63, [5, 9]))
    assert build_plan(ids, cu, min_prefix=16) is not None
    assert build_plan(ids, cu, min_prefix=16, chunk_aligned=True) is None


def test_a_root_dropped_by_the_cut_takes_its_nested_nodes_along():
    root, turn = list(range(110)), list(range(200, 310))  # root cut to 64 < min_prefix 100
    seqs = [root + [900], root + turn + [901], root + turn + [902]]
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=100)
    assert plan is not None and plan.depth == 2
    assert build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=100, chunk_aligned=True) is None


def test_nested_nodes_are_cut_to_chunk_boundaries_of_the_sequence():
    root, turn = list(range(100)), list(range(200, 270))  # nodes [0, 100) and [100, 170)
    seqs = [root + [900], root + turn + [901], root + turn + [902]]
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16, chunk_aligned=True)
    assert [(n.members, n.start, n.end, n.parent) for n in plan.nodes] == [((0, 1, 2), 0, 64, None), ((1, 2), 64, 128, 0)]
    assert plan.gdn.src_identity
