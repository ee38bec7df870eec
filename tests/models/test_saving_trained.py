"""A model trained with the generated classes moves back to upstream's classes with every weight it learned.

tests/models/test_loading.py saves a model as it was loaded; here one optimizer step first changes every
text weight (each MoE expert included), so a save that wrote anything but the trained tensors, in any
layout but upstream's, shows. Both checkpoint layouts, a tied head in the published layout, sharded
bfloat16, and state dicts exchanged directly (FSDP, DeepSpeed and TRL's reference models hand them over
with ``load_state_dict``)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.models import checkpoints as ckpt
from tests.models import tiny

TARGETS = sorted(tiny.MODULES)
VISION = "model.visual."  # a text-only batch gives the vision tower no gradient


@pytest.fixture(autouse=True)
def _torch_linear_attention(monkeypatch):
    """The npu target's Triton kernels run in the CPU interpreter here (seconds per training step); these tests
    are about weights, which no kernel choice changes (tests/triton checks those kernels against the torch ones)."""
    from patchgen.kernels import ops

    for slot in ("gated_delta_rule", "causal_conv1d", "rms_norm_gated"):
        monkeypatch.setenv(f"PATCHGEN_OPS_{slot.upper()}", "torch")
    ops.reset_default()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per (model, layout), saved by upstream's class."""
    paths = {}
    for model in ("qwen3_5", "qwen3_5_moe"):
        for layout in ckpt.LAYOUTS:
            paths[model, layout] = tmp_path_factory.mktemp(f"{model}_{layout}")
            ckpt.save_upstream(model, layout, paths[model, layout])
    return paths


def _trained(net):
    """``net`` after one AdamW step on a causal-LM loss (no weight decay: only a gradient moves a weight)."""
    before = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    net.train()
    ids = ckpt.ids(seed=1)
    net(input_ids=ids, labels=ids).loss.backward()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    optimizer.step()
    optimizer.zero_grad()
    _assert_every_text_weight_moved(net, before)
    return net.eval()


def _assert_every_text_weight_moved(net, before):
    unmoved = [name for name, tensor in net.state_dict().items()
               if not name.startswith(VISION) and _left_as_loaded(tensor, before[name], name)]
    assert not unmoved, f"the step left {unmoved[:3]} as loaded: the test would not see a stale save"


def _left_as_loaded(tensor, loaded, name) -> bool:
    # a fused experts tensor moves if any expert does; each expert has to, or a save that lost one would pass
    if ".mlp.experts." in name:
        return any(torch.equal(tensor[e], loaded[e]) for e in range(tensor.shape[0]))
    return torch.equal(tensor, loaded)


def _logits(net, ids):
    with torch.no_grad():
        return net(input_ids=ids).logits


def _assert_same_tensors(ours, theirs):
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for name, tensor in ours.state_dict().items():
        assert theirs.state_dict()[name].dtype == tensor.dtype, name
        assert torch.equal(theirs.state_dict()[name], tensor), name


def _assert_same_model(ours, theirs):
    _assert_same_tensors(ours, theirs)
    ids = ckpt.ids(seed=2)
    # float32 on CPU: the op-slot kernels and upstream's round differently (test_loading.py)
    torch.testing.assert_close(_logits(theirs, ids), _logits(ours, ids), rtol=1e-4, atol=1e-5)


def _tensors(path):
    return {name: tensor for file in sorted(path.glob("*.safetensors")) for name, tensor in load_file(file).items()}


@pytest.mark.parametrize("layout", ckpt.LAYOUTS)
@pytest.mark.parametrize("model,device", TARGETS)
def test_upstream_loads_every_weight_we_trained(model, device, layout, saved, tmp_path):
    ours, _ = ckpt.load(ckpt.generated_class(model, device, layout), saved[model, layout])
    _trained(ours).save_pretrained(tmp_path)
    if model == "qwen3_5_moe":  # upstream's layout: one tensor per expert, as the published checkpoints
        assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in _tensors(tmp_path))
    theirs, report = ckpt.load(ckpt.upstream_class(model, layout), tmp_path)
    assert all(not keys for keys in report.values()), report
    _assert_same_model(ours, theirs)
    again, report = ckpt.load(ckpt.generated_class(model, device, layout), tmp_path)
    assert all(not keys for keys in report.values()), report
    _assert_same_tensors(ours, again)


@pytest.mark.parametrize("dest", ckpt.LAYOUTS)
@pytest.mark.parametrize("model,device", TARGETS)
def test_a_trained_head_tied_in_the_published_layout_saves_tied_for_upstream(model, device, dest, tmp_path):
    """The published layout ties on its composite config only; after training through the embedding, upstream's
    class of the same name must load our save with the head it trained (its ForCausalLM leaves the published
    checkpoint's head random: test_loading.py), not a random or stale one."""
    config = ckpt.vl_config(model)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    published = ckpt.upstream_class(model, "ForConditionalGeneration")(config)
    tiny.randomize(published, 0).save_pretrained(tmp_path / "published")
    ours, _ = ckpt.load(ckpt.generated_class(model, device, dest), tmp_path / "published")
    _trained(ours).save_pretrained(tmp_path / "ours")
    assert "lm_head.weight" not in _tensors(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["tie_word_embeddings"] is True
    theirs, report = ckpt.load(ckpt.upstream_class(model, dest), tmp_path / "ours")
    assert all(not keys for keys in report.values()), report
    assert theirs.lm_head.weight.data_ptr() == theirs.get_input_embeddings().weight.data_ptr()
    _assert_same_model(ours, theirs)


@pytest.mark.parametrize("model,device", TARGETS)
def test_a_trained_published_layout_saved_in_bfloat16_shards_loads_into_upstream(model, device, saved, tmp_path):
    ours, _ = ckpt.load(ckpt.generated_class(model, device, "ForConditionalGeneration"), saved[model, "ForConditionalGeneration"],
                        dtype=torch.bfloat16)
    _trained(ours).save_pretrained(tmp_path, max_shard_size="8KB")
    shards = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    experts = {file for name, file in shards.items() if ".layers.0.mlp.experts." in name}
    assert len(set(shards.values())) > 1 and (model == "qwen3_5" or len(experts) > 1)
    theirs, report = ckpt.load(ckpt.upstream_class(model, "ForConditionalGeneration"), tmp_path, dtype="auto")
    assert all(not keys for keys in report.values()), report
    assert {tensor.dtype for tensor in theirs.state_dict().values()} == {torch.bfloat16}
    _assert_same_tensors(ours, theirs)


@pytest.mark.parametrize("model,device", TARGETS)
def test_state_dicts_exchange_strictly_with_upstreams_classes(model, device, saved):
    """The published layout's classes (the text classes exchange them in tiny.upstream_model, for every parity test)."""
    layout = "ForConditionalGeneration"
    ours, _ = ckpt.load(ckpt.generated_class(model, device, layout), saved[model, layout])
    _trained(ours)
    torch.manual_seed(1)
    theirs = ckpt.upstream_class(model, layout)(ckpt.config_for(model, layout)).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    _assert_same_model(ours, theirs)
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.mul_(0.5)
    torch.manual_seed(1)
    back = ckpt.generated_class(model, device, layout)(ckpt.config_for(model, layout)).eval()
    back.load_state_dict(theirs.state_dict(), strict=True)
    _assert_same_tensors(back, theirs)
