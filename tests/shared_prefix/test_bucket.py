"""Plans padded to bucket counts (`shared_prefix/bucket.py`): the ladder, the padding's shapes, and the
mixers on a padded plan equal the unpadded ones on every real row (float64), while nothing real reads a
padding row and the padding rows receive no gradient."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from patchgen.kernels.errors import CudaGraphsUnavailable
from patchgen.kernels.graphs.signature import describe, plan_signature
from patchgen.kernels.reference import attention as ref_attention
from patchgen.kernels.reference.causal_conv1d import causal_conv1d as ref_conv
from patchgen.kernels.reference.gated_delta_rule import gated_delta_rule as ref_gdn
from patchgen.kernels.shared_prefix import bucket as bucket_module
from patchgen.kernels.shared_prefix import (
    build_plan,
    shared_prefix_attention,
    shared_prefix_causal_conv1d,
    shared_prefix_gated_delta_rule,
)
from patchgen.kernels.shared_prefix.bucket import CHUNK, REUSE, cost, merge, pad_lengths, rung
from patchgen.kernels.shared_prefix.gdn import chunk_indices
from patchgen.kernels.shared_prefix.gdn_rounds import ReferenceRounds

from tests.shared_prefix.references import pack
from tests.shared_prefix.test_properties import SETTINGS, packed_batches

F64 = {"dtype": torch.float64}
CPU = torch.device("cpu")


def _row(groups, singles=(), seed=0):
    """A packed row: per group `(prompt, [responses])` the rollouts, then singletons (token ids >= 1000)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for p, responses in groups:
        head = torch.randint(1000, 2000, (p,), generator=g)
        seqs += [torch.cat([head, torch.randint(1000, 2000, (r,), generator=g)]) for r in responses]
    seqs += [torch.randint(1000, 2000, (n,), generator=g) for n in singles]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return torch.cat(seqs).reshape(1, -1), cu


def _plans(groups, singles=(), **kwargs):
    ids, cu = _row(groups, singles)
    return build_plan(ids, cu, **kwargs), build_plan(ids, cu, pad_to_bucket=True, **kwargs)


# one-level GRPO rows, a two-level tree (a shared system prompt over two prompts) and a chunk-aligned plan
LAYOUTS = [
    ({"groups": [(70, [5, 9, 3])]}, {}),
    ({"groups": [(130, [40, 3, 77, 1]), (64, [12, 20])], "singles": (9, 70)}, {}),
    ({"groups": [(100, [66, 5])], "singles": (130,)}, {"chunk_aligned": True}),
]


def _tree_row():
    g = torch.Generator().manual_seed(5)
    system = torch.randint(1000, 2000, (80,), generator=g)
    seqs = []
    for prompt_len, responses in ((70, [9, 30]), (65, [4, 11, 2])):
        prompt = torch.randint(1000, 2000, (prompt_len,), generator=g)
        seqs += [torch.cat([system, prompt, torch.randint(1000, 2000, (r,), generator=g)]) for r in responses]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return torch.cat(seqs).reshape(1, -1), cu


def _all_plans():
    out = [_plans(**layout, **kwargs) for layout, kwargs in LAYOUTS]
    ids, cu = _tree_row()
    out.append((build_plan(ids, cu, max_depth=2, level_cost=0), build_plan(ids, cu, max_depth=2, level_cost=0,
                                                                          pad_to_bucket=True)))
    assert out[-1][1].depth == 2  # the tree plan really has two levels (three GDN rounds)
    return out


PLANS = _all_plans()


def test_the_ladder_wastes_at_most_one_eighth():
    values = [rung(x) for x in range(1, 20000)]
    assert all(v >= x for x, v in zip(range(1, 20000), values))
    assert all(v <= x * 9 / 8 + 1 for x, v in zip(range(1, 20000), values))
    assert values == sorted(values)
    assert len(set(values)) < 80  # a few dozen buckets up to 20k rows


@pytest.mark.parametrize(("count", "rows", "chunks"), [(1, 1, 1), (1, 64, 1), (3, 3, 3), (3, 192, 3), (4, 200, 5),
                                                       (2, 65, 2), (5, 900, 16)])
def test_padding_lengths_make_the_rows_and_chunks_asked(count, rows, chunks):
    lengths = pad_lengths(count, rows, chunks)
    assert len(lengths) == count and lengths.min() >= 1
    assert lengths.sum() == rows and (-(-lengths // CHUNK)).sum() == chunks


def test_impossible_padding_is_an_error():
    with pytest.raises(AssertionError, match="no 2 padding sequences"):
        pad_lengths(2, 200, 2)


@pytest.mark.parametrize("pair", PLANS, ids=["grpo", "groups+singles", "chunk-aligned", "tree"])
def test_a_padded_plan_keeps_every_real_row(pair):
    plain, padded = pair
    c, c_star = plain.compact_length, padded.compact_length
    assert c < c_star <= c * 9 / 8 + 1 + 8  # at least one padding row, at most the ladder's step (and a few)
    assert torch.equal(padded.compact_src[:c], plain.compact_src)
    assert torch.equal(padded.expand_index, plain.expand_index)  # no packed position reads a padding row
    assert torch.equal(padded.position_ids[..., :c], plain.position_ids)
    assert torch.equal(padded.position_ids[..., c:].reshape(-1), torch.arange(c_star - c))
    assert torch.equal(padded.lm.rows, plain.lm.rows)  # no LM row on padding
    assert padded.bucket[0] == c_star and plain.bucket is None


@pytest.mark.parametrize("pair", PLANS, ids=["grpo", "groups+singles", "chunk-aligned", "tree"])
def test_every_chunk_table_of_a_padded_plan_is_its_boundaries_own(pair):
    _, padded = pair
    tables = [rnd for rnd in padded.gdn.rounds] + [padded.gdn.joint]
    assert all(rnd is not None for rnd in tables)  # padding gives round 0 rows even when no root had any
    for rnd in tables:
        lengths = np.diff(rnd.cu_seqlens.numpy()).astype(np.int64)
        assert lengths.min() >= 1  # no empty sequence
        assert np.array_equal(rnd.chunk_indices.numpy(), chunk_indices(lengths))
        assert np.array_equal(rnd.chunk_offsets.numpy(), np.concatenate([[0], np.cumsum(-(-lengths // CHUNK))]))
        assert rnd.cu_seqlens_cpu is None  # never keyed by value
    conv = padded.conv
    lengths = np.diff(conv.segment_cu.numpy()).astype(np.int64)
    assert lengths.min() >= 1 and conv.segment_cu[-1] == padded.compact_length + len(conv.extra_src)
    assert np.array_equal(conv.segment_chunks.numpy(), chunk_indices(lengths))


def _bucket_mates():
    """Two GRPO rows whose prompt and response lengths differ, in one bucket."""
    a = _plans([(70, [5, 9, 3])])[1]
    b = _plans([(68, [6, 8, 2])])[1]
    c = _plans([(200, [40, 3, 9])])[1]
    return a, b, c


def test_layouts_of_one_bucket_have_one_key_and_another_bucket_another():
    a, b, c = _bucket_mates()
    assert a.bucket == b.bucket != c.bucket
    assert plan_signature(a.for_layers(), CPU) == plan_signature(b.for_layers(), CPU)
    assert plan_signature(a.for_layers(), CPU) != plan_signature(c.for_layers(), CPU)
    # the index tensors differ in contents only: a graph's static buffers take either by copy
    assert not torch.equal(a.gdn.src, b.gdn.src)
    assert describe(a.gdn.src, device=CPU) == describe(b.gdn.src, device=CPU)


def _gdn_inputs(c, seed, h=2, hv=4, k=4, v=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, c, h, k, generator=g, **F64)
    kk = torch.randn(1, c, h, k, generator=g, **F64)
    vv = torch.randn(1, c, hv, v, generator=g, **F64)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, c, hv, generator=g, **F64))
    beta = torch.rand(1, c, hv, generator=g, **F64)
    return [q, kk, vv, gate, beta]


def _padded_inputs(real, c_star, seed):
    """The real rows, then padding rows of random values (what a padded step would hold there)."""
    pad = _gdn_inputs(c_star - real[0].shape[1], seed + 100) if len(real) == 5 else None
    if pad is None:
        g = torch.Generator().manual_seed(seed + 100)
        pad = [torch.randn(x.shape[0], c_star - x.shape[1], *x.shape[2:], generator=g, **F64) for x in real]
    return [torch.cat([x, p], dim=1) for x, p in zip(real, pad)]


def _check_mixer(plain, padded, run, real_inputs, weights=()):
    """The padded mixer equals the unpadded one on real rows (outputs, input and weight gradients); padding
    rows get zero gradient; other padding values, or a gradient on the padding outputs, leave the real rows'
    outputs and input gradients as they were (nothing real reads a padding row, either way)."""
    c, c_star = plain.compact_length, padded.compact_length
    xs = [x.clone().requires_grad_() for x in real_inputs]
    ws = [w.clone().requires_grad_() for w in weights]
    out = run(plain, *xs, *ws)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(out, xs + ws, grad)
    padded_in = [x.requires_grad_() for x in _padded_inputs(real_inputs, c_star, 1)]
    ws2 = [w.clone().requires_grad_() for w in weights]
    out2 = run(padded, *padded_in, *ws2)
    assert out2.shape[1] == c_star
    torch.testing.assert_close(out2[:, :c], out, atol=1e-12, rtol=0)
    no_pad_grad = torch.cat([grad, torch.zeros_like(out2[:, c:])], 1)
    found = torch.autograd.grad(out2, padded_in + ws2, no_pad_grad, retain_graph=True)
    for e, f in zip(expected[: len(xs)], found[: len(xs)]):
        torch.testing.assert_close(f[:, :c], e, atol=1e-12, rtol=0)
        assert torch.count_nonzero(f[:, c:]) == 0  # nothing flows into padding rows
    for e, f in zip(expected[len(xs):], found[len(xs):]):
        torch.testing.assert_close(f, e, atol=1e-12, rtol=0)
    pad_grad = torch.cat([grad, torch.randn_like(out2[:, c:])], 1)
    for e, f in zip(expected, torch.autograd.grad(out2, padded_in, pad_grad)):
        torch.testing.assert_close(f[:, :c], e, atol=1e-12, rtol=0)
    other = [x.detach() for x in _padded_inputs(real_inputs, c_star, 2)]
    with torch.no_grad():
        assert torch.equal(run(padded, *other, *weights)[:, :c], out2[:, :c].detach())


@pytest.mark.parametrize("pair", PLANS, ids=["grpo", "groups+singles", "chunk-aligned", "tree"])
@pytest.mark.parametrize("rounds", [False, True], ids=["loop", "rounds"])
def test_gated_delta_rule_on_a_padded_plan(pair, rounds):
    plain, _ = pair
    fn = ref_gdn
    if rounds:
        def fn(*args, **kwargs):
            return ref_gdn(*args, **kwargs)
        fn.table_free = True
        fn.rounds = ReferenceRounds(fn)

    def run(plan, q, k, v, g, beta):
        return shared_prefix_gated_delta_rule(plan, fn, q, k, v, g, beta, use_qk_l2norm_in_kernel=True)

    _check_mixer(*pair, run, _gdn_inputs(plain.compact_length, 0))


@pytest.mark.parametrize("pair", PLANS, ids=["grpo", "groups+singles", "chunk-aligned", "tree"])
def test_causal_conv1d_on_a_padded_plan(pair):
    plain, _ = pair
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, plain.compact_length, 6, generator=g, **F64)
    weight, bias = torch.randn(6, 4, generator=g, **F64), torch.randn(6, generator=g, **F64)

    def run(plan, x, w, b):
        return shared_prefix_causal_conv1d(plan, ref_conv, x, w, b, activation="silu")

    _check_mixer(*pair, run, [x], [weight, bias])


@pytest.mark.parametrize("pair", PLANS, ids=["grpo", "groups+singles", "chunk-aligned", "tree"])
def test_attention_on_a_padded_plan(pair):
    plain, _ = pair
    g = torch.Generator().manual_seed(4)
    c = plain.compact_length
    q, k, v = (torch.randn(1, c, heads, 8, generator=g, **F64) for heads in (4, 2, 2))

    def run(plan, q, k, v):
        return shared_prefix_attention(plan, ref_attention.eager, q, k, v, scale=8**-0.5)

    _check_mixer(*pair, run, [q, k, v])


def test_a_gdn_backend_that_makes_its_own_chunk_tables_is_refused_on_a_padded_plan():
    _, padded = PLANS[0]
    inputs = _gdn_inputs(padded.compact_length, 0)

    def public(*args, **kwargs):  # a public function that would derive (and cache) its tables
        return ref_gdn(*args, **kwargs)

    with pytest.raises(CudaGraphsUnavailable, match="derives chunk tables from cu_seqlens"):
        shared_prefix_gated_delta_rule(padded, public, *inputs)

    class OwnOffsets(ReferenceRounds):  # stages that take chunk_indices but derive chunk_offsets (fla's _Rounds)
        plan_tables = False

    public.rounds = OwnOffsets(ref_gdn)
    with pytest.raises(CudaGraphsUnavailable, match="derives chunk tables from cu_seqlens"):
        shared_prefix_gated_delta_rule(padded, public, *inputs)


def test_a_conv_without_state_kernels_is_refused_on_a_padded_plan():
    _, padded = PLANS[0]

    def gathered_only(x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None):
        return ref_conv(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens)

    x = torch.randn(1, padded.compact_length, 6, **F64)
    with pytest.raises(CudaGraphsUnavailable, match="needs a causal_conv1d backend with state kernels"):
        shared_prefix_causal_conv1d(padded, gathered_only, x, torch.randn(6, 4, **F64))


def _reuse_case():
    ids, cu = _row([(70, [5, 9, 3])])
    plain, own = build_plan(ids, cu), build_plan(ids, cu, pad_to_bucket=True)
    larger = _plans([(90, [12, 9, 6])])[1].bucket  # a little larger: fits, within REUSE of the own bucket's cost
    much_larger = _plans([(300, [120, 90, 60])])[1].bucket
    smaller = _plans([(66, [1, 2, 3])])[1].bucket
    return ids, cu, plain, own, (larger, much_larger, smaller)


def test_a_layout_pads_to_a_held_bucket_it_fits_at_little_more_cost():
    ids, cu, _, own, (larger, much_larger, smaller) = _reuse_case()
    needs_cost = cost(own.bucket)
    assert own.bucket != larger and needs_cost < cost(larger) <= REUSE * needs_cost
    assert cost(much_larger) > REUSE * needs_cost
    reused = build_plan(ids, cu, pad_to_bucket=True, held_buckets=(much_larger, smaller, larger))
    assert reused.bucket == larger  # the one that fits and costs little more; neither too large nor too small
    assert build_plan(ids, cu, pad_to_bucket=True, held_buckets=(much_larger, smaller)).bucket == own.bucket


def test_mixers_on_a_plan_padded_to_a_held_bucket():
    ids, cu, plain, _, (larger, _, _) = _reuse_case()
    reused = build_plan(ids, cu, pad_to_bucket=True, held_buckets=(larger,))
    _check_every_mixer(plain, reused, seed=6)


def _check_every_mixer(plain, padded, seed):
    """GDN, conv and attention on `padded` equal them on `plain` (float64, outputs and gradients)."""
    pair = (plain, padded)
    g = torch.Generator().manual_seed(seed)
    c = plain.compact_length

    def gdn(plan, q, k, v, gate, beta):
        return shared_prefix_gated_delta_rule(plan, ref_gdn, q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)

    def conv(plan, x, w, b):
        return shared_prefix_causal_conv1d(plan, ref_conv, x, w, b, activation="silu")

    def attention(plan, q, k, v):
        return shared_prefix_attention(plan, ref_attention.eager, q, k, v, scale=8**-0.5)

    _check_mixer(*pair, gdn, _gdn_inputs(c, 0))
    _check_mixer(*pair, conv, [torch.randn(1, c, 6, generator=g, **F64)],
                 [torch.randn(6, 4, generator=g, **F64), torch.randn(6, generator=g, **F64)])
    _check_mixer(*pair, attention, [torch.randn(1, c, heads, 8, generator=g, **F64) for heads in (4, 2, 2)])


def _round_rows(rnd_list, out_index):
    """(round, row within the round) of each entry of a GDN out_index."""
    starts = np.cumsum([0] + [r.rows for r in rnd_list])
    of = np.searchsorted(starts, out_index, side="right") - 1
    return of, out_index - starts[of]


@settings(max_examples=40, **SETTINGS)
@given(packed_batches(), st.integers(1, 3), st.booleans())
def test_padding_leaves_every_real_index_as_it_was(batch, depth, aligned):
    seqs, positions, min_prefix = batch
    ids, cu = pack(seqs)
    kwargs = {"min_prefix": min_prefix, "max_depth": depth, "level_cost": 0, "chunk_aligned": aligned}
    plain = build_plan(ids, cu, positions, **kwargs)
    if plain is None:
        return
    padded = build_plan(ids, cu, positions, pad_to_bucket=True, **kwargs)
    _check_padded(plain, padded)
    # the same batch padded to the bucket of a longer one (every sequence a few tokens longer), when it fits
    longer = [list(x) + [7] * 5 for x in seqs]
    other = build_plan(*pack(longer), None if positions is None else _longer_positions(longer), pad_to_bucket=True,
                       **kwargs)
    if other is not None and other.bucket != padded.bucket:
        reused = build_plan(ids, cu, positions, pad_to_bucket=True, held_buckets=(other.bucket,), **kwargs)
        assert reused.bucket in (other.bucket, padded.bucket, merge((padded.bucket, other.bucket)))
        _check_padded(plain, reused)
        merged = merge((padded.bucket, other.bucket))
        if merged is not None:  # both batches fit the merge of their buckets (the cost budget lifted)
            budget, bucket_module.REUSE = bucket_module.REUSE, float("inf")
            try:
                mate = build_plan(*pack(longer), None if positions is None else _longer_positions(longer),
                                  pad_to_bucket=True, held_buckets=(merged,), **kwargs)
                again = build_plan(ids, cu, positions, pad_to_bucket=True, held_buckets=(merged,), **kwargs)
            finally:
                bucket_module.REUSE = budget
            assert mate.bucket == merged and again.bucket == merged
            _check_padded(plain, again)


def _longer_positions(seqs):
    per_seq = torch.cat([torch.arange(len(x)) for x in seqs]).reshape(1, -1)
    return per_seq.expand(3, -1).reshape(3, 1, -1).clone()


def _check_padded(plain, padded):
    c, c_star = plain.compact_length, padded.compact_length
    assert c_star > c and torch.equal(padded.compact_src[:c], plain.compact_src)
    assert torch.equal(padded.position_ids[..., :c], plain.position_ids)
    # GDN: every real sequence of every round starts with its rows as they were, from its state as it was, and
    # fills its last chunk with padding rows; a later round reads only states of sequences that end on a chunk
    # boundary; padding reads padding rows
    real_rounds = [r for r in plain.gdn.rounds if r is not None]
    padded_rounds = list(padded.gdn.rounds)
    places = []  # per real round, the padded round's row of each of its rows
    for r, rnd in enumerate(plain.gdn.rounds):
        pad = padded_rounds[r]
        if rnd is None:
            assert pad.src.min() >= c
            continue
        n = rnd.num_sequences
        lengths = np.diff(rnd.cu_seqlens.numpy())
        filled = np.diff(pad.cu_seqlens[: n + 1].numpy())
        assert np.array_equal(filled, CHUNK * -(-lengths // CHUNK))  # whole chunks: no slack to pad for
        starts = pad.cu_seqlens[:n].numpy().astype(np.int64)
        place = torch.from_numpy(np.concatenate([np.arange(a, a + b) for a, b in zip(starts, lengths)]))
        places.append(place.numpy())
        assert torch.equal(pad.src[place], rnd.src)
        others = torch.ones(pad.rows, dtype=torch.bool)
        others[place] = False
        assert pad.src[others].min() >= c
        if rnd.state_index is not None:
            assert torch.equal(pad.state_index[:n], rnd.state_index + (0 if rnd.zero_state else 1))
            assert pad.zero_state and not pad.state_index[n:].any()
            read = rnd.state_index - (1 if rnd.zero_state else 0)
            before = real_rounds[len(places) - 2]
            assert not (np.diff(before.cu_seqlens.numpy())[read[read >= 0].numpy()] % CHUNK).any()
    p_round, p_row = _round_rows(padded_rounds, padded.gdn.out_index[:c].numpy())
    present = [r for r, rnd in enumerate(plain.gdn.rounds) if rnd is not None]
    u_round, u_row = _round_rows(real_rounds, plain.gdn.out_index.numpy())
    assert np.array_equal(p_round, np.array(present)[u_round])
    assert np.array_equal(p_row, np.array([places[r][row] for r, row in zip(u_round, u_row)], dtype=np.int64))
    # conv: real segments and their look-back as they were; padding segments start from zeros
    s = plain.conv.segment_cu.numel() - 1
    assert torch.equal(padded.conv.segment_cu[: s + 1], plain.conv.segment_cu)
    assert torch.equal(padded.conv.state_rows[:s], plain.conv.state_rows)
    assert (padded.conv.state_rows[s:] == -1).all() and padded.conv.extra_src.min() >= c
    assert padded.conv.segment_cu[-1] == c_star + padded.conv.extra_src.numel()
    # attention: real segments as they were; padding segments' keys are padding rows
    att, patt = plain.attention, padded.attention
    s, keys = att.cu_seqlens_q.numel() - 1, att.kv_src.numel()
    assert torch.equal(patt.cu_seqlens_q[: s + 1], att.cu_seqlens_q) and patt.cu_seqlens_q[-1] == c_star
    assert torch.equal(patt.cu_seqlens_k[: s + 1], att.cu_seqlens_k) and torch.equal(patt.kv_src[:keys], att.kv_src)
    assert patt.kv_src[keys:].min() >= c
    q, k = (torch.diff(x).max().item() for x in (patt.cu_seqlens_q, patt.cu_seqlens_k))
    assert q <= patt.max_seqlen_q and k <= patt.max_seqlen_k


def test_the_compact_row_pads_at_most_one_sixteenth():
    """The compact row (the GEMMs' rows, most of a step) goes up a 17/16 ladder: at most 6.25% padding rows
    beyond the one per padding attention segment (the old 9/8 ladder allowed 12.5%)."""
    found = []
    for prompt in range(64, 400, 7):
        plain, padded = _plans([(prompt, [5, 9, 3])])
        c, segments = plain.compact_length, plain.attention.cu_seqlens_q.numel() - 1
        extra = padded.attention.cu_seqlens_q.numel() - 1 - segments  # a padding row (at least) each
        found.append(padded.compact_length / (c + extra))
    assert max(found) <= 17 / 16 and min(found) >= 1


def test_a_round_of_sequences_ending_mid_chunk_gets_one_padding_sequence():
    """Every real GDN sequence fills its last chunk with padding rows, so the slack of sequences that end
    mid-chunk needs no padding sequence of its own: a round gets one padding sequence beyond the sequences
    its structure allows, and one chunk for it (then the ladder)."""
    plain, padded = _plans([(130, [40, 3, 77, 1, 20, 33, 50, 9])])  # eight responses, each ending mid-chunk
    real, pad = plain.gdn.rounds[1], padded.gdn.rounds[1]
    lengths = np.diff(real.cu_seqlens.numpy())
    assert (lengths % CHUNK).all()
    assert real.num_sequences == 9  # the prompt's tail (2 rows past its last chunk boundary) alone, 8 segments
    assert pad.num_sequences == rung(9) + 1  # one padding sequence (it was one per sequence: rung(9) + rung(9))
    real_chunks = real.chunk_indices.shape[0]
    assert pad.chunk_indices.shape[0] == rung(real_chunks + pad.num_sequences - real.num_sequences)
    assert pad.rows == CHUNK * pad.chunk_indices.shape[0]  # nothing short of whole chunks


def _merge_case():
    first = [(200, [10, 20, 15])]  # a long prompt, short responses
    second = [(170, [40, 50, 45])]  # a shorter prompt, longer responses: fits neither way round
    held = _plans(first)[1].bucket
    plain, own = _plans(second)
    ids, cu = _row(second)
    return first, held, plain, own, build_plan(ids, cu, pad_to_bucket=True, held_buckets=(held,))


def test_a_capture_between_held_buckets_takes_their_merge():
    """A layout that fits no held bucket captures the merge of its own bucket with a held one when that costs
    little more: a bucket that both layouts fit, so the next layout like either replays."""
    first, held, _, own, captured = _merge_case()
    assert own.bucket != held and captured.bucket == merge((own.bucket, held))
    assert captured.bucket not in (own.bucket, held) and cost(captured.bucket) <= REUSE * cost(own.bucket)
    ids, cu = _row(first)
    assert build_plan(ids, cu, pad_to_bucket=True, held_buckets=(captured.bucket,)).bucket == captured.bucket


def test_a_capture_merges_with_every_held_bucket_when_that_costs_little_more():
    """With two held buckets, the merge with both (not the cheaper merge with one): every layout of the held
    graphs replays it afterwards, so the merges converge on one bucket instead of a cache of partial ones."""
    first, second, third = [(200, [10, 20, 15])], [(160, [50, 40, 30])], [(170, [40, 50, 45])]
    held = (_plans(first)[1].bucket, _plans(second)[1].bucket)
    ids, cu = _row(third)
    captured = build_plan(ids, cu, pad_to_bucket=True, held_buckets=held).bucket
    assert captured == merge((_plans(third)[1].bucket, *held)) and captured not in held
    assert captured != min((merge((_plans(third)[1].bucket, b)) for b in held), key=cost)  # more than a pair's
    for groups in (first, second):
        ids, cu = _row(groups)
        assert build_plan(ids, cu, pad_to_bucket=True, held_buckets=(captured,)).bucket == captured


def test_mixers_on_a_plan_padded_to_a_merged_bucket():
    _, _, plain, _, captured = _merge_case()
    _check_padded(plain, captured)
    _check_every_mixer(plain, captured, seed=7)


@pytest.mark.parametrize("second", [[(150, [60, 70, 40])], [(140, [80, 70, 60])], [(130, [100, 90, 70])]])
def test_a_layout_that_fits_a_bucket_fits_its_merge_with_another(second, monkeypatch):
    """Whatever fits one of two buckets fits their merge (the cost budget aside: lifted here)."""
    first = [(200, [10, 20, 15])]
    merged = merge((_plans(first)[1].bucket, _plans(second)[1].bucket))
    monkeypatch.setattr(bucket_module, "REUSE", 100.0)
    for groups in (first, second):
        ids, cu = _row(groups)
        assert build_plan(ids, cu, pad_to_bucket=True, held_buckets=(merged,)).bucket == merged


def test_merging_buckets_of_other_tree_shapes_gives_none():
    ids, cu = _tree_row()
    tree = build_plan(ids, cu, max_depth=2, level_cost=0, pad_to_bucket=True).bucket
    assert merge((tree, PLANS[0][1].bucket)) is None


def test_the_gpu_tests_layouts_of_one_bucket_share_it_on_the_host():
    """The bucket is host data: the H200 test's two layouts of one bucket (and one of another) are checked
    here, where CI runs, so that a change of the ladder cannot leave that test's premise false unseen."""
    from tests.shared_prefix.test_layer_graphs_gpu import BUCKET, OTHER_BUCKET

    first, second, other = (_plans([groups])[1].bucket for groups in (*BUCKET, OTHER_BUCKET))
    assert first == second != other


def test_rent_or_buy_pads_to_a_held_bucket_until_its_padding_has_cost_a_capture():
    """`PaddingRegret` (the bucket bench's alternative policy): a layout pads to a held larger bucket while the padding
    owed stays under a capture's cost, in steps of its own work; then it captures the merge of the own buckets that
    paid, cheaper than the held one, and owes nothing again."""
    ids, cu, _, own, (larger, _, _) = _reuse_case()
    excess = cost(larger) / cost(own.bucket) - 1
    regret = bucket_module.PaddingRegret(capture_steps=2.5 * excess)
    chosen = [build_plan(ids, cu, pad_to_bucket=True, held_buckets=(larger,), padding_regret=regret).bucket
              for _ in range(3)]
    assert chosen[:2] == [larger, larger] and chosen[2] == own.bucket  # the merge of one own bucket is itself
    assert larger not in regret.owed and larger not in regret.owns and cost(chosen[2]) < cost(larger)
    assert build_plan(ids, cu, pad_to_bucket=True, held_buckets=(larger,)).bucket == larger  # the fixed bound
