"""Generation continued from the cache a first generate() returned equals upstream's, state by state.

A checkpoint saved by upstream's ForConditionalGeneration (the published layout) is loaded into upstream's
ForCausalLM and into the generated one of every target, flag on and off (and into both ForConditionalGeneration
classes, flag on). Each generates 3 tokens, then 3 more
from its own returned cache; the hybrid cache (attention keys/values, GatedDeltaNet conv and recurrent states)
must hold upstream's tensors after either call, and the tokens must be upstream's."""

import copy

import pytest
import torch

from tests.models import checkpoints as ckpt
from tests.models import tiny

PAD = 0
FIRST, MORE = 3, 3


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    paths = {}
    for model in ("qwen3_5", "qwen3_5_moe"):
        paths[model] = tmp_path_factory.mktemp(f"{model}_published")
        ckpt.save_upstream(model, "ForConditionalGeneration", paths[model])
    return paths


def _prompts():
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(2, tiny.VOCAB, (n,), generator=gen) for n in (9, 5)]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.full((width - len(r),), PAD), r]) for r in rows])
    mask = torch.stack([torch.arange(width) >= width - len(r) for r in rows]).long()
    return ids, mask


def _generate(net, ids, mask, new_tokens, cache=None):
    return net.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                        use_cache=True, return_dict_in_generate=True, output_logits=True, pad_token_id=PAD,
                        eos_token_id=None)


def cache_states(cache) -> dict[str, torch.Tensor]:
    """Every tensor a hybrid cache holds, by layer and kind (keys, values, conv_states, recurrent_states)."""
    states = {}
    for index, layer in enumerate(cache.layers):
        for kind in ("keys", "values", "conv_states", "recurrent_states"):
            held = getattr(layer, kind, None)
            items = held.items() if isinstance(held, dict) else [(0, held)]
            for slot, tensor in items:
                if isinstance(tensor, torch.Tensor) and tensor.numel():
                    states[f"layer{index}.{kind}[{slot}]"] = tensor.detach().clone()
    return states


def generate_then_continue(net):
    """(first output, states after it, continued output, states after it)."""
    ids, mask = _prompts()
    first = _generate(net, ids, mask, FIRST)
    after_first = cache_states(first.cache)
    grown = torch.cat([mask, torch.ones(mask.shape[0], FIRST, dtype=mask.dtype)], dim=1)
    more = _generate(net, first.sequences, grown, MORE, cache=copy.deepcopy(first.cache))
    return first, after_first, more, cache_states(more.cache)


def _load(cls, path, **fields):
    config = cls.config_class.from_pretrained(path)
    text = getattr(config, "text_config", config)
    if hasattr(text, "output_router_logits"):
        # Upstream's aux loss in generate() fails on a padded batch when router logits are asked for (decode steps
        # hold one token a row, the mask the whole row; ours fails alike); generation does not need them.
        text.output_router_logits = False
    net, report = cls.from_pretrained(path, config=config, dtype=torch.float32, output_loading_info=True, **fields)
    assert not any(report.values()), report  # every weight from the checkpoint, none random
    return net.eval()


@pytest.fixture(scope="module")
def upstream_runs(published):
    runs = {}
    for model, path in published.items():
        for name in ("ForCausalLM", "ForConditionalGeneration"):
            net = _load(ckpt.upstream_class(model, name), path)
            ids, mask = _prompts()
            runs[model, name] = generate_then_continue(net), _generate(net, ids, mask, FIRST + MORE).sequences
    return runs


def _assert_states_equal(ours, theirs):
    assert ours.keys() == theirs.keys()
    kinds = {name.split(".")[1].split("[")[0] for name in theirs}
    assert kinds == {"keys", "values", "conv_states", "recurrent_states"}  # the hybrid cache is really compared
    for name, tensor in theirs.items():
        # float32 (the dtype of the cache is compared too): our op slots and upstream's fallbacks round differently.
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["ForCausalLM", "ForConditionalGeneration"])
@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_upstream_continuing_from_its_cache_equals_one_generate_call(model, name, upstream_runs):
    (_, _, more, _), one_call = upstream_runs[model, name]
    assert torch.equal(more.sequences, one_call)  # the contract the comparison below leans on


def _assert_continues_as_upstream(net, upstream):
    first, after_first, more, after_more = generate_then_continue(net)
    (up_first, up_after_first, up_more, up_after_more), _ = upstream
    assert torch.equal(first.sequences, up_first.sequences)
    _assert_states_equal(after_first, up_after_first)
    assert torch.equal(more.sequences, up_more.sequences)
    torch.testing.assert_close(torch.stack(more.logits, 1), torch.stack(up_more.logits, 1), rtol=1e-4, atol=1e-5)
    _assert_states_equal(after_more, up_after_more)
    assert more.cache.get_seq_length() == up_more.cache.get_seq_length() == more.sequences.shape[1] - 1


@pytest.mark.parametrize("flag", [False, True], ids=["flag_off", "flag_on"])
@pytest.mark.parametrize("model,device", sorted(tiny.MODULES))
def test_continuing_from_the_returned_cache_equals_upstream(model, device, flag, published, upstream_runs):
    net = _load(ckpt.generated_class(model, device, "ForCausalLM"), published[model], shared_prefix_training=flag)
    assert net.config.shared_prefix_training is flag
    _assert_continues_as_upstream(net, upstream_runs[model, "ForCausalLM"])


@pytest.mark.parametrize("model,device", sorted(tiny.MODULES))
def test_the_vision_language_class_continues_from_its_cache_as_upstreams(model, device, published, upstream_runs):
    """Text-only prompts through ForConditionalGeneration (its multimodal rope offsets are kept between calls)."""
    net = _load(ckpt.generated_class(model, device, "ForConditionalGeneration"), published[model],
                shared_prefix_training=True)
    assert net.config.text_config.shared_prefix_training is True
    _assert_continues_as_upstream(net, upstream_runs[model, "ForConditionalGeneration"])
