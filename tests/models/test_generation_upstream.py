"""A user's flow: a checkpoint saved by upstream's ForConditionalGeneration, loaded through the auto classes
after patchgen.register, generates what upstream's own class generates (greedy, padded batch, cache or not)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import patchgen
from patchgen.integrations import auto
from tests.models import checkpoints as ckpt
from tests.models import tiny

PAD = 0


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    path = tmp_path_factory.mktemp("published")
    ckpt.save_upstream("qwen3_5", "ForConditionalGeneration", path)
    return path


def _generate(net, use_cache):
    ids, mask = tiny.left_padded_batch((5, 24, 9), pad=PAD)
    net.generation_config.pad_token_id = PAD
    return net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=use_cache,
                        eos_token_id=None, pad_token_id=PAD)


@pytest.fixture(scope="module")
def upstream_tokens(published):
    auto.unregister()
    net = ckpt.upstream_class("qwen3_5", "ForCausalLM").from_pretrained(published, dtype=torch.float64).eval()
    return _generate(net, use_cache=True)


@pytest.mark.parametrize(
    "device,flag,use_cache", [("gpu", True, True), ("gpu", True, False), ("npu", True, True)]
)
def test_greedy_generation_equals_upstreams_from_the_published_layout(published, upstream_tokens, device, flag, use_cache):
    patchgen.register(device)
    try:
        net = AutoModelForCausalLM.from_pretrained(
            published, dtype=torch.float64, shared_prefix_training=flag, shared_prefix_verify=flag
        ).eval()
    finally:
        auto.unregister()
    assert type(net) is ckpt.generated_class("qwen3_5", device, "ForCausalLM")
    assert net.config.shared_prefix_training is flag
    assert torch.equal(_generate(net, use_cache), upstream_tokens)
