"""Shared-prefix guards (shared_prefix.md section 4, G1-G6)."""

import pytest
import torch
from patchgen.kernels import ops
from patchgen.kernels.errors import BackendUnavailable
from patchgen.kernels.modeling import shared_prefix

from tests.models import tiny


def _batch():
    return tiny.grpo_batch([(70, [5, 9, 3])], [20], seed=11)


@pytest.fixture
def net():
    return tiny.build("qwen3_5", "gpu", shared_prefix_training=True)


def test_g1_mtp_on_a_packed_row_raises(net):
    ids, cu, _ = _batch()
    with pytest.raises(NotImplementedError, match="multi-token prediction"):
        net(input_ids=ids, use_mtp=True, **tiny.packed_kwargs(cu))


def test_g1_use_cache_on_a_packed_row_takes_the_ordinary_packed_path(net):
    ids, cu, _ = _batch()
    off = tiny.build("qwen3_5", "gpu")
    a = net(input_ids=ids, use_cache=True, **tiny.packed_kwargs(cu)).logits
    assert torch.equal(a, off(input_ids=ids, **tiny.packed_kwargs(cu)).logits)


def test_g1_a_cache_with_a_packed_row_is_a_clear_error(net):
    from patchgen.kernels.modeling.boundaries import PackedMetadataError
    from transformers import DynamicCache

    ids, cu, _ = _batch()
    with pytest.raises(PackedMetadataError, match="with a cache"):
        net(input_ids=ids, cache=DynamicCache(config=net.config), **tiny.packed_kwargs(cu))


def test_g2_sequence_parallel_raises_before_any_plan(net, monkeypatch):
    def no_plan(*args, **kwargs):
        raise AssertionError("a plan was built")

    monkeypatch.setattr(shared_prefix, "build_plan", no_plan)
    ids, cu, _ = _batch()
    with pytest.raises(NotImplementedError, match="sequence parallel"):
        net(input_ids=ids, sequence_parallel=True, **tiny.packed_kwargs(cu))
    net.config.sequence_parallel_size = 2
    with pytest.raises(NotImplementedError, match="sequence parallel"):
        net(input_ids=ids, **tiny.packed_kwargs(cu))


def test_g3_inputs_embeds_only_and_media_take_the_ordinary_path(net):
    ids, cu, _ = _batch()
    off = tiny.build("qwen3_5", "gpu")
    embeds = off.model.embed_tokens(ids)
    a = net(inputs_embeds=embeds, **tiny.packed_kwargs(cu)).logits
    b = off(inputs_embeds=embeds, **tiny.packed_kwargs(cu)).logits
    assert torch.equal(a, b)
    kwargs = dict(input_ids=ids, position_ids=None, cache=None, use_cache=None, kwargs=tiny.packed_kwargs(cu))
    assert shared_prefix.plan_for(net.config, ops.of(net), pixel_values=torch.zeros(1), **kwargs) is None
    assert shared_prefix.plan_for(net.config, ops.of(net), pixel_values_videos=torch.zeros(1), **kwargs) is None
    assert shared_prefix.plan_for(net.config, ops.of(net), **kwargs) is not None


class _Handle:
    def __init__(self, name, capabilities):
        self.name, self.capabilities = name, frozenset(capabilities)


class _Table:
    def __init__(self, real, slot, handle):
        self.real, self.slot, self.fake = real, slot, handle

    def handle(self, slot):
        return self.fake if slot == self.slot else self.real.handle(slot)


@pytest.mark.parametrize("slot,caps,working", [
    ("gated_delta_rule", {"varlen", "initial_state"}, "torch"),
    ("attention", {"varlen"}, "eager"),
])
def test_g4_backend_without_capability_names_working_backends(net, slot, caps, working):
    ids, cu, _ = _batch()
    table = _Table(ops.of(net), slot, _Handle("nostate", caps))
    with pytest.raises(BackendUnavailable, match=working) as info:
        shared_prefix.plan_for(net.config, table, input_ids=ids, position_ids=None, cache=None, use_cache=None,
                               kwargs=tiny.packed_kwargs(cu))
    assert slot in str(info.value) and "nostate" in str(info.value)


def test_g5_all_ones_attention_mask_is_ignored(net):
    ids, cu, _ = _batch()
    a = net(input_ids=ids, attention_mask=torch.ones_like(ids), **tiny.packed_kwargs(cu)).logits
    b = net(input_ids=ids, **tiny.packed_kwargs(cu)).logits
    assert torch.equal(a, b)


def test_g6_an_unpacked_batch_takes_the_ordinary_path_with_the_flag_on(net):
    ids, _, _ = _batch()
    off = tiny.build("qwen3_5", "gpu")
    rows = ids[:, :96].reshape(2, 48)
    assert torch.equal(net(input_ids=rows).logits, off(input_ids=rows).logits)


def test_flag_off_by_default_and_no_group_runs_packed():
    net = tiny.build("qwen3_5", "gpu")
    assert not shared_prefix.enabled(net.config)
    on = tiny.build("qwen3_5", "gpu", shared_prefix_training=True)
    ids, cu = tiny.packed_batch([40, 50], seed=1)
    assert torch.equal(on(input_ids=ids, **tiny.packed_kwargs(cu)).logits, net(input_ids=ids, **tiny.packed_kwargs(cu)).logits)
