"""The conv's look-back as a per-sequence initial state (issue 15): float64, outputs and every gradient.

The reference conv takes `initial_state`; the shared-prefix conv then runs every segment as its own
sequence with its parent's last W-1 rows as that state (`LookBackConv`) and equals packed execution
to 1e-10, on one-level plans, on trees, and where a segment starts fewer than W-1 rows into its sequence.
"""

import itertools
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from patchgen.kernels import capabilities as caps
from patchgen.kernels import registry
from patchgen.kernels.reference.causal_conv1d import LookBackFromX
from patchgen.kernels.reference.causal_conv1d import causal_conv1d as conv
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_causal_conv1d

from tests.models.prefix_trees import pack, prefix_trees
from tests.shared_prefix.test_tree import agentic, spine

F64 = {"dtype": torch.float64}


def gathered(x, weight, bias, cu, state):
    """The definition: each sequence convolved after its state rows, the state rows' outputs dropped."""
    w = weight.shape[1]
    bounds = cu.tolist()
    outs = []
    for n, (a, b) in enumerate(itertools.pairwise(bounds)):
        if a == b:
            continue
        rows = torch.cat([state[n], x[0, a:b]])[None]
        outs.append(conv(rows, weight, bias, activation="silu")[0, w - 1 :])
    return torch.cat(outs)[None]


def test_initial_state_is_read_by_the_taps_before_each_start():
    cu = torch.tensor([0, 5, 5, 6, 14], dtype=torch.int32)  # a zero-length and a one-row sequence
    x = torch.randn(1, 14, 3, **F64, requires_grad=True)
    weight = torch.randn(3, 4, **F64, requires_grad=True)
    bias = torch.randn(3, **F64, requires_grad=True)
    state = torch.randn(4, 3, 3, **F64, requires_grad=True)
    got = conv(x, weight, bias, activation="silu", cu_seqlens=cu, initial_state=state)
    want = gathered(x, weight, bias, cu, state)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    dy = torch.randn_like(got)
    leaves = (x, weight, bias, state)
    for a, b in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_zero_initial_state_is_no_initial_state():
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    x, weight = torch.randn(1, 9, 2, **F64), torch.randn(2, 4, **F64)
    with_zeros = conv(x, weight, cu_seqlens=cu, initial_state=torch.zeros(2, 3, 2, **F64))
    assert torch.equal(with_zeros, conv(x, weight, cu_seqlens=cu))


def test_initial_state_of_the_wrong_shape_is_refused():
    cu = torch.tensor([0, 2, 9], dtype=torch.int32)
    x, weight = torch.randn(1, 9, 2, **F64), torch.randn(2, 4, **F64)
    with pytest.raises(ValueError, match=r"initial_state must be \[sequences, W-1, D\] = \[2, 3, 2\]"):
        conv(x, weight, cu_seqlens=cu, initial_state=torch.zeros(2, 4, 2, **F64))


class Counting:
    """The reference behind a slot function, counting slot calls and state-kernel calls."""

    def __init__(self, with_state=True, layout="rows"):
        self.calls, self.state_calls = 0, 0
        if with_state:
            self.look_back = _CountingLookBack(self, conv.look_back if layout == "rows" else LookBackFromX())

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return conv(*args, **kwargs)


class _CountingLookBack:
    def __init__(self, owner, inner):
        self.owner, self.inner, self.layout = owner, inner, inner.layout

    def forward(self, *args):
        self.owner.state_calls += 1
        return self.inner.forward(*args)

    def backward(self, *args):
        return self.inner.backward(*args)


def check(ref, plan, cu, width=4, channels=3, bias=True):
    """Shared conv on the state path vs packed, in both state protocols (the state gathered around the
    call, "rows"; the rows of x read by the kernels, "x"); the state path must be the one taken."""
    for layout in ("rows", "x"):
        x = torch.randn(1, plan.compact_length, channels, **F64, requires_grad=True)
        params = [torch.randn(channels, width, **F64, requires_grad=True)]
        if bias:
            params.append(torch.randn(channels, **F64, requires_grad=True))
        fn = Counting(layout=layout)
        ref.assert_matches_packed(
            plan,
            lambda x, w, b=None, fn=fn: shared_prefix_causal_conv1d(plan, fn, x, w, b, activation="silu"),
            lambda x, w, b=None: ref.causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu),
            [x],
            params,
        )
        assert (fn.calls, fn.state_calls) == (0, 1)


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 2000, (n,), generator=g).tolist()


def test_one_level_groups_singletons_and_empty_sequences(ref):
    pa, pb = tokens(100, 1), tokens(128, 2)
    seqs = [pa + tokens(7, 3), tokens(20, 4), pb + tokens(5, 5), pa + [9], [], pb + tokens(3, 6), pa + tokens(12, 7)]
    ids, cu = ref.pack(seqs)
    plan = build_plan(ids, cu)
    assert len(plan.groups) == 2
    check(ref, plan, cu)


def test_a_conv_narrower_than_the_plan_reads_fewer_state_rows(ref):
    ids, cu = pack(agentic(prompt=70, turns=(64,), last=2))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0)
    check(ref, plan, cu, width=2, bias=False)


@pytest.mark.parametrize("prompt", [64, 30])  # 30: a root below a chunk
def test_a_three_level_tree(ref, prompt):
    ids, cu = pack(spine(3, root=prompt))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16)
    assert plan.depth == 3
    check(ref, plan, cu)


def test_a_prefix_shorter_than_the_look_back_reads_zeros_before_it(ref):
    """A 2-row shared prefix: its children start 2 rows into their sequences, one state slot is zero."""
    seqs = [[5, 6, 7, 8, 9], [5, 6, 1, 2], [5, 6, 3]]
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, min_prefix=2)
    assert [n.end - n.start for n in plan.nodes] == [2]
    check(ref, plan, cu)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prefix_trees(depth=(2, 3), fan_out=(2, 3), lengths=(63, 64, 65, 100), leaf=(1, 3), spine=True))
def test_random_trees(ref, batch):
    seqs, _, positions = batch
    ids, cu = pack(seqs)
    check(ref, build_plan(ids, cu, positions, max_depth=4, level_cost=0), cu)


def test_a_backend_without_state_kernels_takes_the_gathered_rows(ref):
    ids, cu = pack(spine(2))
    plan = build_plan(ids, cu, max_depth=4, level_cost=0, min_prefix=16)
    x, weight = torch.randn(1, plan.compact_length, 3, **F64), torch.randn(3, 4, **F64)
    fn = Counting(with_state=False)
    got = plan.expand(shared_prefix_causal_conv1d(plan, fn, x, weight))
    assert fn.calls == 1
    torch.testing.assert_close(got, ref.causal_conv1d(plan.expand(x), weight, cu_seqlens=cu), rtol=0, atol=1e-10)


@pytest.mark.parametrize("slot_backend", [h.name for h in registry.BACKENDS["causal_conv1d"]])
def test_a_conv_declares_the_initial_state_gradient_exactly_when_it_has_state_kernels(slot_backend):
    handle = registry.handle("causal_conv1d", slot_backend)
    declared = {caps.INITIAL_STATE, caps.INITIAL_STATE_GRAD} <= handle.capabilities
    if not handle.available:
        pytest.skip(f"{slot_backend}: {handle.reason}")
    has_kernels = getattr(handle.load(), "look_back", None) is not None
    # fla's state kernels can be switched off for A/B runs (the gathered rows then serve the state)
    opted_out = slot_backend == "fla" and os.environ.get("PATCHGEN_FLA_CONV_LOOK_BACK") == "0"
    assert has_kernels == (declared and not opted_out)
