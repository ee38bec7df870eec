"""Position rows in the grouping: the fast paths (rows that count up from a constant per sequence,
rows packed into one int64) give exactly the runs and plans of comparing every row.

The reference is the grouping's specification written out naively: candidates bucketed by their
first ids, each bucket sorted by the bytes of its `(id, *position rows)` int64 symbols, and the
common prefix of adjacent sequences counted symbol by symbol, capped so both keep a row.
"""

import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from patchgen.kernels.shared_prefix import build_plan, grouping
from patchgen.kernels.shared_prefix import plan as plan_module
from patchgen.kernels.shared_prefix import positions as positions_module
from patchgen.kernels.shared_prefix.positions import offset_rows

SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}
MODES = [
    "per_sequence",
    "shifted",
    "constants",
    "late_constants",
    "global",
    "broken",
    "negative",
    "wide",
    "one_row_constants",
    "stepped",
    "grid",
    "diverging",
]


@st.composite
def position_batches(draw):
    """Prompts (some under one system prompt) with rollouts, singletons and empty segments, and
    position rows of every kind the grouping tells apart."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    vocab = draw(st.sampled_from([3, 500]))  # 3: long common prefixes and many ties in the sort
    min_prefix = draw(st.sampled_from([16, 64]))

    def toks(n):
        return [rng.randrange(1, vocab + 1) for _ in range(n)]

    system = toks(draw(st.integers(0, 90)))
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = (system if draw(st.booleans()) else []) + toks(draw(st.integers(0, 80)))
        seqs += [prompt + toks(draw(st.integers(0, 6))) for _ in range(draw(st.integers(1, 4)))]
    seqs += [toks(draw(st.integers(0, 80))) for _ in range(draw(st.integers(0, 2)))]
    seqs += [[] for _ in range(draw(st.integers(0, 1)))]
    rng.shuffle(seqs)

    lengths = [len(s) for s in seqs]
    t = sum(lengths)
    local = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64) if seqs else np.zeros(0, np.int64)
    mode = draw(st.sampled_from(MODES))
    rows = np.stack([local] * 3)
    if mode == "shifted":  # the bench's [3,1,T]*: one row offset by one everywhere
        rows[1] += 1
    elif mode in ("constants", "late_constants", "broken", "one_row_constants"):  # a constant per sequence and row
        for r in range(1 if mode == "late_constants" else 0, 3):  # late: row 0 alike, the others not
            rows[r] += np.repeat([rng.choice([0, 0, 0, 5]) for _ in seqs], lengths).astype(np.int64)
    elif mode == "global":
        rows += np.arange(t) - local
    elif mode == "negative":
        rows[2] = -local
    elif mode == "wide":  # needs more than 63 bits as one int64 per row: every row is compared
        rows[1] += (local % 2) << 55
    elif mode == "stepped":  # the bench's [3,1,T]~: one row also steps by 2 at every 4th offset
        rows[1] += 1
        rows[2] += (local % 4 == 0).astype(np.int64)
    elif mode == "grid":  # M-RoPE rows of an image grid: time constant, height and width in a 4-wide grid
        rows[0] = local // 16
        rows[1] = (local // 4) % 4
        rows[2] = local % 4
    elif mode == "diverging" and seqs:  # rollouts' positions part where their ids still agree
        rows[1] += np.repeat([rng.choice([0, 0, 1]) * rng.randrange(2, 90) for _ in seqs], lengths) <= local
    if mode == "broken" and t:
        rows[rng.randrange(3), rng.randrange(t)] += 1
    if mode == "one_row_constants":
        rows = rows[:1]
    return seqs, rows, min_prefix


def reference_runs(seqs, rows, min_prefix):
    """The grouping's sorted runs, computed naively from their definition."""
    key_len = min(grouping.BUCKET_TOKENS, min_prefix)
    cu = np.cumsum([0] + [len(s) for s in seqs])
    ids = np.array([t for s in seqs for t in s], dtype=np.int64)
    block = np.stack([ids, *rows], axis=1)
    symbols = [[tuple(r) for r in block[cu[i] : cu[i + 1]].tolist()] for i in range(len(seqs))]
    buckets = {}
    for i, s in enumerate(seqs):
        if len(s) > min_prefix:
            buckets.setdefault(tuple(s[:key_len]), []).append(i)
    runs = []
    for members in sorted((m for m in buckets.values() if len(m) >= 2), key=min):
        order = sorted(members, key=lambda i: block[cu[i] : cu[i + 1]].tobytes())
        adjacent = []
        for a, b in itertools.pairwise(order):
            n = min(len(seqs[a]), len(seqs[b]))
            k = 0
            while k < n and symbols[a][k] == symbols[b][k]:
                k += 1
            adjacent.append(min(k, n - 1))
        runs.append((order, adjacent))
    return runs


def host(seqs, rows):
    ids = np.array([t for s in seqs for t in s], dtype=np.int64)
    return ids, [0, *np.cumsum([len(s) for s in seqs]).tolist()]


@settings(max_examples=60, **SETTINGS)
@given(position_batches())
def test_sorted_runs_equal_the_naive_symbol_order_and_prefixes(monkeypatch, batch):
    seqs, rows, min_prefix = batch
    ids, cu = host(seqs, rows)
    expected = reference_runs(seqs, rows, min_prefix)
    assert grouping.sorted_runs(ids, rows, cu, min_prefix) == expected
    with monkeypatch.context() as patched:
        patched.setattr(grouping, "PAIRWISE_MAX", 0)  # as many pairs as a 64k batch: rows compared at once
        assert grouping.sorted_runs(ids, rows, cu, min_prefix) == expected
        patched.setattr(grouping, "_SCRATCH_KEPT", 0)  # a row too long to keep its scratch buffer
        assert grouping.sorted_runs(ids, rows, cu, min_prefix) == expected


def plan_arrays(plan):
    if plan is None:
        return None
    nodes = [(n.members, n.start, n.end, n.parent) for n in plan.nodes]
    tensors = ("compact_src", "expand_index", "position_ids", "cu_seqlens")
    return nodes, [getattr(plan, k).tolist() for k in tensors], plan.lm.length


@settings(max_examples=25, **SETTINGS)
@given(position_batches(), st.sampled_from([1, 4]))
def test_fast_paths_build_the_plans_of_comparing_every_row(monkeypatch, batch, depth):
    seqs, rows, min_prefix = batch
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    positions = torch.from_numpy(rows).reshape(len(rows), 1, -1)
    options = {"min_prefix": min_prefix, "max_depth": depth, "level_cost": 0}
    with monkeypatch.context() as patched:
        patched.setattr(grouping, "PAIRWISE_MAX", 0)  # as many pairs as a 64k batch: rows packed into one
        fast = plan_arrays(build_plan(ids, cu, positions, **options))
    with monkeypatch.context() as patched:
        patched.setattr(grouping, "PAIRWISE_MAX", 0)
        patched.setattr(grouping, "sequence_offsets", lambda *args, **kwargs: None)
        patched.setattr(grouping, "row_symbols", lambda *args, **kwargs: None)
        patched.setattr(grouping, "_runs_in_id_order", lambda *args, **kwargs: None)
        patched.setattr(plan_module, "offset_rows", lambda *args, **kwargs: None)
        assert plan_arrays(build_plan(ids, cu, positions, **options)) == fast


def reference_offset_rows(seqs, rows):
    """`offset_rows` from its definition: per sequence and row, value by value."""
    starts = np.cumsum([0] + [len(s) for s in seqs])
    at = {}  # (row, offset) -> the value every sequence holds there
    per_sequence = True
    for r, row in enumerate(rows.tolist()):
        for i, s in enumerate(seqs):
            for o in range(len(s)):
                value = row[starts[i] + o]
                if at.setdefault((r, o), value) != value:
                    return None
                per_sequence &= value == o
    return "per_sequence" if per_sequence else "offset"


@settings(max_examples=80, **SETTINGS)
@given(position_batches())
def test_offset_rows_tell_rows_that_depend_only_on_the_offset(monkeypatch, batch):
    seqs, rows, _ = batch
    _, cu = host(seqs, rows)
    expected = reference_offset_rows(seqs, rows)
    assert offset_rows(rows, cu) == expected  # few sequences: a slice compare each
    monkeypatch.setattr(positions_module, "FEW_SEQUENCES", 0)  # many: one gather of each distinct row
    assert offset_rows(rows, cu) == expected


@pytest.mark.parametrize(
    ("row", "kind"),
    [
        ([0, 1, 2, 0, 1], "per_sequence"),
        ([1, 2, 3, 1, 2], "offset"),  # counts from 1 everywhere: one function of the offset
        ([0, 1, 1, 0, 1], "offset"),  # does not count up, but alike in both sequences
        ([0, 1, 2, 1, 2], None),  # the second sequence starts elsewhere
        ([0, 1, 2, 0, 2], None),  # and here it differs at its last row only
        ([0, 5, 2, 0, 1], None),  # and here inside the longest one, which no first or last row shows
    ],
)
@pytest.mark.parametrize("few", [0, 32])
def test_offset_rows_on_two_sequences(monkeypatch, row, kind, few):
    monkeypatch.setattr(positions_module, "FEW_SEQUENCES", few)
    assert offset_rows(np.array([row]), [0, 3, 3, 5]) == kind  # an empty sequence in the middle


def grid_rollouts(diverge_at=None):
    """Two prompts with an image-grid-like position row, four rollouts each; with `diverge_at`, one
    rollout's positions step away from its siblings' there while its ids still agree with them."""
    rng = random.Random(3)
    seqs = []
    for _ in range(2):
        prompt = [rng.randrange(1, 500) for _ in range(100)]
        seqs += [prompt + [rng.randrange(1, 500) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    local = [np.arange(len(s)) for s in seqs]
    rows = np.stack([np.concatenate(local), np.concatenate([o // 8 for o in local])])
    if diverge_at is not None:
        rows[1, diverge_at : len(seqs[0])] += 1  # in the first rollout, from offset diverge_at on
    return seqs, rows, 64


def test_rows_that_follow_the_ids_are_grouped_in_the_order_of_the_ids_alone(monkeypatch):
    """Positions that agree wherever the ids do (an image grid's rows): the runs come from sorting
    by the ids and comparing them, with the positions only checked; they are the symbol order's."""
    monkeypatch.setattr(grouping, "PAIRWISE_MAX", 0)
    seqs, rows, min_prefix = grid_rollouts()
    ids, cu = host(seqs, rows)
    candidates = np.flatnonzero(np.diff(cu) > min_prefix)
    scratch = grouping.Arena(np.empty(16 * len(ids), np.int64))
    fast = grouping._runs_in_id_order(ids, list(rows), rows, np.asarray(cu), candidates, min_prefix, scratch)
    assert fast == reference_runs(seqs, rows, min_prefix)
    assert [len(order) for order, _ in fast] == [4, 4]


@pytest.mark.parametrize("pairwise_max", [0, 128])
def test_a_position_that_differs_where_the_ids_agree_takes_the_symbol_order(monkeypatch, pairwise_max):
    """The id order is not the symbol order once a rollout's positions part from its siblings'
    before its ids do: the fast path declines, and the runs are still the symbol order's."""
    monkeypatch.setattr(grouping, "PAIRWISE_MAX", pairwise_max)
    seqs, rows, min_prefix = grid_rollouts(diverge_at=80)
    ids, cu = host(seqs, rows)
    candidates = np.flatnonzero(np.diff(cu) > min_prefix)
    scratch = grouping.Arena(np.empty(16 * len(ids), np.int64))
    assert grouping._runs_in_id_order(ids, list(rows), rows, np.asarray(cu), candidates, min_prefix, scratch) is None
    runs = grouping.sorted_runs(ids, rows, cu, min_prefix)
    assert runs == reference_runs(seqs, rows, min_prefix)
    assert 80 in runs[0][1]  # the parted rollout shares 80 rows with its siblings


def test_sequence_offsets_are_what_each_row_adds_to_the_sequences_own_count():
    cu = np.array([0, 3, 3, 5])  # an empty sequence in the middle
    rows = [np.array([0, 1, 2, 7, 8]), np.array([5, 6, 7, 0, 1])]
    assert grouping.sequence_offsets(rows, cu).tolist() == [[0, 5], [0, 0], [7, 0]]


# [0, 2, 2]: ends where a count would, but does not count
@pytest.mark.parametrize("row", [[0, 1, 1, 0, 1], [0, 2, 4, 0, 1], [0, 1, 2, 1, 0], [0, 2, 2, 0, 1]])
def test_a_row_that_does_not_count_up_by_one_has_no_offsets(row):
    assert grouping.sequence_offsets([np.arange(5), np.array(row)], np.array([0, 3, 5])) is None


def test_row_symbols_are_equal_exactly_where_the_id_and_every_position_row_are():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 3, 400)
    first = rng.integers(-25, 25, 400)  # M-RoPE-like: the later rows differ from the first by little
    rows = [first, first + rng.integers(0, 2, 400) + 2**40, first + 2 * rng.integers(0, 2, 400)]
    packed = grouping.row_symbols(ids, rows)
    full = np.stack([ids, *rows], axis=1)
    same_symbol = (full[:, None, :] == full[None, :, :]).all(axis=2)
    assert np.array_equal(packed[:, None] == packed[None, :], same_symbol)


def test_row_symbols_give_up_past_63_bits():
    ids = np.array([0, 2**20])
    assert grouping.row_symbols(ids, [np.array([0, 2**42])]) is None
    assert grouping.row_symbols(ids, [np.array([0, 2**41])]) is not None


def test_threads_building_plans_at_once_each_get_their_own_scratch(monkeypatch):
    """The grouping's temporaries live in a buffer kept per thread: plans built at once in several
    threads (a trainer's prefetch threads) get the runs of building them one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(grouping, "PAIRWISE_MAX", 0)  # every pair compared at once, in the scratch buffer
    rng = random.Random(5)
    batches = []
    for vocab, shift in ((3, 0), (4, 1), (500, 7), (3, 2)):  # different rows, lengths and position rows
        system = [rng.randrange(1, vocab + 1) for _ in range(70)]
        seqs = [system + [rng.randrange(1, vocab + 1) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
        local = np.concatenate([np.arange(len(s)) for s in seqs]).astype(np.int64)
        rows = np.stack([local, local + shift, 2 * local])  # not per-sequence counts: the symbols path
        batches.append((seqs, rows, 16))
    expected = [reference_runs(*batch) for batch in batches]

    def runs(i):
        seqs, rows, min_prefix = batches[i % len(batches)]
        ids, cu = host(seqs, rows)
        return grouping.sorted_runs(ids, rows, cu, min_prefix)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(runs, range(40)))
    assert got == [expected[i % len(batches)] for i in range(40)]


@pytest.mark.parametrize("mode", ["none", "stepped"])
def test_many_sequences_sort_as_few_do(mode):
    """Past 128 candidates the sort keys are cut from one copy of the row: same runs as the definition."""
    rng = random.Random(11)
    seqs = []
    for _ in range(3):
        prompt = [rng.randrange(1, 4) for _ in range(40)]
        seqs += [prompt + [rng.randrange(1, 4) for _ in range(rng.randrange(1, 30))] for _ in range(50)]
    rng.shuffle(seqs)
    local = np.concatenate([np.arange(len(s)) for s in seqs]).astype(np.int64)
    rows = np.stack([local, local + 1, local + (local % 4 == 0)])
    ids, cu = host(seqs, rows)
    positions = None if mode == "none" else rows
    expected = reference_runs(seqs, np.zeros((0, len(ids)), np.int64) if positions is None else rows, 16)
    runs = grouping.sorted_runs(ids, positions, cu, 16)
    assert runs == expected
    assert sum(len(order) for order, _ in runs) > 128


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6), tail=st.integers(0, 5),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_positions_from_boundaries_restart_at_every_sequence_and_count_on_past_the_last(lengths, tail, dtype):
    """The host's positions (numpy) are the device's (torch's search) and the naive count: 0, 1, ... from every
    sequence start, empty sequences included, and rows past the last boundary counting on from it."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype)
    length = int(cu[-1]) + tail
    naive = [i for n in lengths for i in range(n)] + list(range(tail))
    host = positions_module.positions_from_cu_seqlens(cu, length)
    assert host.dtype == torch.int64 and host.tolist() == [naive]
    assert positions_module._searched_on_device(cu, length).tolist() == [naive]  # the device's way, run here
