"""The graphs' key, static buffers and cache (`patchgen.kernels.graphs`), on plans built on the CPU.

A key must tell apart every pair of calls a graph cannot serve both of (another response length,
another max length, another parameter storage) and match calls that differ only in data (other
tokens, same layout); a load must leave every static buffer equal to the batch's tensor; the cache
evicts least recently used first and warns when most calls capture."""

import dataclasses
import warnings

import pytest
import torch
from patchgen.kernels.errors import CudaGraphsUnavailable
from patchgen.kernels.graphs import GraphCache, StaticCall, call_signature, plan_signature
from patchgen.kernels.graphs.cache import Entry, GraphsRecapturing
from patchgen.kernels.graphs.replay import uncached_autocast
from patchgen.kernels.graphs.static import device_paths
from patchgen.kernels.shared_prefix import build_plan

from tests.models import tiny

CPU = torch.device("cpu")


def _plan(groups, seed=0):
    ids, cu, _ = tiny.grpo_batch(groups, seed=seed)
    return build_plan(ids, cu, min_prefix=16)


def _call(plan, hidden_size=8):
    c = plan.compact_length
    hidden = torch.randn(1, c, hidden_size, requires_grad=True)
    cos_sin = (torch.randn(1, c, 4), torch.randn(1, c, 4))
    return hidden, cos_sin, {"full_attention": None, "linear_attention": None}, {"shared_prefix": plan, "use_cache": False}


def _key(plan, layers=()):
    return call_signature(*_call(plan), layers, "shared_prefix")


def test_same_layout_other_tokens_share_a_key():
    assert _key(_plan([(100, [20, 30])], seed=1)) == _key(_plan([(100, [20, 30])], seed=2))


@pytest.mark.parametrize("other", [[(100, [20, 31])], [(100, [30, 20])], [(101, [20, 30])], [(100, [20, 30, 5])]])
def test_another_layout_has_another_key(other):
    assert _key(_plan([(100, [20, 30])])) != _key(_plan(other))


def test_a_host_int_the_kernels_read_is_in_the_key():
    plan = _plan([(100, [20, 30])])
    longer = dataclasses.replace(plan, attention=dataclasses.replace(plan.attention, max_seqlen_k=plan.attention.max_seqlen_k + 1))
    assert plan_signature(plan, CPU) != plan_signature(longer, CPU)


def test_parameter_storage_and_requires_grad_are_in_the_key():
    plan = _plan([(100, [20, 30])])
    layer = torch.nn.Linear(4, 4)
    before = _key(plan, [layer])
    layer.weight.requires_grad_(False)
    assert _key(plan, [layer]) != before
    layer.weight.requires_grad_(True)
    layer.weight.data = layer.weight.data.clone()  # moved: the graph would read the old storage
    assert _key(plan, [layer]) != before


def test_a_submodule_swapped_in_changes_the_key():
    plan = _plan([(100, [20, 30])])
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = _key(plan, [layer])
    layer[0] = torch.nn.Sequential(layer[0], torch.nn.Linear(4, 4))  # an adapter wrapped around it
    assert _key(plan, [layer]) != before


def test_an_argument_the_key_cannot_describe_is_refused():
    hidden, cos_sin, masks, kwargs = _call(_plan([(100, [20, 30])]))
    with pytest.raises(CudaGraphsUnavailable, match="layer keyword\\['cache'\\] of type object"):
        call_signature(hidden, cos_sin, masks, {**kwargs, "cache": object()}, (), "shared_prefix")


def test_a_load_makes_every_static_buffer_the_batchs():
    first, second = _plan([(100, [20, 30])], seed=1), _plan([(100, [20, 30])], seed=2)
    _, cos_a, masks, kwargs = _call(first)
    static = StaticCall.of(torch.zeros(1, first.compact_length, 8), cos_a, masks, kwargs)
    # the conv's derived state-gather indices, as a warm-up would have built them on the static plan
    static.kwargs["shared_prefix"].conv.state_gather(4, 6, "fla")
    paths = device_paths((static.position_embeddings, static.masks, static.kwargs), CPU)
    buffers = _tensors_at(static, paths)
    assert buffers and all(b.numel() for b in buffers)
    for b in buffers:
        b.fill_(-1) if b.dtype != torch.bool else b.fill_(False)
    _, cos_b, _, kwargs_b = _call(second)
    static.load(cos_b, masks, kwargs_b)
    batch = StaticCall(None, cos_b, masks, kwargs_b)
    batch.kwargs["shared_prefix"].conv.state_gather(4, 6, "fla")
    # the batch's plan also holds the look-back indices other tests of this process asked for (`conv._WANTED`): the
    # static's keys are the ones its graph reads
    for mine, theirs in zip(_tensors_at(static, paths), _tensors_at(batch, paths, static), strict=True):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr()


def _tensors_at(call, paths, keys_of=None):
    """The tensors at `paths`; a conv index's derived ones in the order of `keys_of`'s keys (default: its own)."""
    from patchgen.kernels.graphs.static import _at

    def tree_of(c):
        return (c.position_embeddings, c.masks, c.kwargs)

    out = []
    for path in paths:
        found = _at(tree_of(call), path)
        if path[-1] is None:
            keys = _at(tree_of(keys_of or call), path).state_index
            out += [t for key in keys for t in found.state_index[key]]
        else:
            out.append(found)
    return out


def _entry():
    return Entry(static=None, replay=None, params=[])


def test_the_cache_evicts_the_least_recently_used_entry():
    cache = GraphCache(max_entries=2)
    cache.put("a", _entry())
    cache.put("b", _entry())
    assert cache.get("a") is not None  # a is now the most recent
    cache.make_room()
    cache.put("c", _entry())
    assert (cache.get("b"), cache.get("a") is not None, cache.get("c") is not None) == (None, True, True)
    assert (cache.stats.captures, cache.stats.replays, cache.stats.evictions) == (3, 3, 1)


def test_the_cache_warns_once_when_most_calls_capture():
    cache = GraphCache(max_entries=1, warn_after=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(6):
            cache.make_room()
            cache.put(i, _entry())
    assert [w.category for w in seen] == [GraphsRecapturing]
    assert "6 of 6" not in str(seen[0].message) and "4 of 4" in str(seen[0].message)


def test_eager_calls_count_against_the_captures_before_the_cache_warns():
    """Under "auto" most calls may run eagerly and only a few capture: that is no recapturing."""
    cache = GraphCache(max_entries=1, warn_after=4)
    cache.stats.eager = 10
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(11):
            cache.make_room()
            cache.put(i, _entry())
            if i < 10:  # 10 captures of 20 calls: not most
                assert seen == []
    assert [w.category for w in seen] == [GraphsRecapturing] and "11 of 21" in str(seen[0].message)


def test_a_cache_of_no_entries_is_refused():
    with pytest.raises(ValueError, match="at least one entry"):
        GraphCache(max_entries=0)


def test_a_layer_switched_to_eval_changes_the_key():
    plan = _plan([(100, [20, 30])])
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))  # a LoRA adapter's dropout, say
    before = _key(plan, [layer])
    layer.eval()  # a graph captured in training mode would keep dropping
    assert _key(plan, [layer]) != before


def test_a_layer_argument_other_than_the_hidden_states_that_wants_a_gradient_is_refused():
    hidden, (cos, sin), masks, kwargs = _call(_plan([(100, [20, 30])]))
    with pytest.raises(CudaGraphsUnavailable, match=r"position_embeddings\[0\], a tensor that requires grad"):
        call_signature(hidden, (cos.requires_grad_(), sin), masks, kwargs, (), "shared_prefix")


def test_captures_cast_the_current_weights_under_autocast():
    # autocast keeps its first cast of a weight for the whole region: a graph captured on that cache hit
    # would replay the weights of the capture step forever
    weight, x = torch.nn.Parameter(torch.ones(4, 4)), torch.ones(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(x, weight)
        with torch.no_grad():
            weight.mul_(2)  # an optimizer step
        stale = torch.nn.functional.linear(x, weight)
        with uncached_autocast("cpu"):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            fresh = torch.nn.functional.linear(x, weight)
        assert torch.is_autocast_cache_enabled()
    assert stale[0, 0].item() == 4.0  # the cache this guards against
    assert fresh[0, 0].item() == 8.0 and fresh.dtype == torch.bfloat16


def test_op_slots_bound_again_change_the_key():
    from patchgen.kernels import ops

    plan = _plan([(100, [20, 30])])
    layer = torch.nn.Linear(4, 4)
    ops.bind(layer)
    before = _key(plan, [layer])
    assert _key(plan, [layer]) == before
    ops.bind(layer)  # other backends chosen: a graph would replay the ones it captured
    assert _key(plan, [layer]) != before
