"""Checkpoint variants a published model comes in load into the generated classes as into upstream's:
tied embeddings, bfloat16 weights in several safetensors shards (with dtype="auto" and device_map), and our
sharded save back into upstream's class."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.models import checkpoints as ckpt
from tests.models import tiny

TARGETS = sorted(tiny.MODULES)


def _save_upstream(model, path, tied=False, dtype=torch.float32, **save_kwargs):
    config = ckpt.vl_config(model)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = tied
    torch.manual_seed(0)
    net = ckpt.upstream_class(model, "ForConditionalGeneration")(config)
    tiny.randomize(net, 0)
    net.to(dtype).save_pretrained(path, **save_kwargs)


def _assert_same_tensors(ours, theirs):
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for name, tensor in theirs.state_dict().items():
        assert ours.state_dict()[name].dtype == tensor.dtype, name
        assert torch.equal(ours.state_dict()[name], tensor), name


def _shard_files(path):
    return sorted(p.name for p in path.glob("*.safetensors"))


@pytest.mark.parametrize("model,device", TARGETS)
def test_tied_embeddings_stay_tied_and_save_as_upstream_saves(model, device, tmp_path):
    _save_upstream(model, tmp_path / "published", tied=True)
    ours, report = ckpt.load(ckpt.generated_class(model, device, "ForCausalLM"), tmp_path / "published")
    theirs, upstream_report = ckpt.load(ckpt.upstream_class(model, "ForCausalLM"), tmp_path / "published")
    assert report == upstream_report and report["missing_keys"] == []
    _assert_same_tensors(ours, theirs)
    # One tensor, not a copy: training the embedding trains the head, as upstream's does.
    assert ours.lm_head.weight.data_ptr() == ours.get_input_embeddings().weight.data_ptr()
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    assert load_file(tmp_path / "ours" / "model.safetensors").keys() == load_file(
        tmp_path / "theirs" / "model.safetensors"
    ).keys()


@pytest.mark.parametrize("load_kwargs", [{"dtype": "auto"}, {"dtype": "auto", "device_map": "cpu"}], ids=["auto", "device_map"])
@pytest.mark.parametrize("model,device", TARGETS)
def test_sharded_bfloat16_checkpoint_loads_with_upstreams_dtypes(model, device, load_kwargs, tmp_path):
    _save_upstream(model, tmp_path, dtype=torch.bfloat16, max_shard_size="20KB")
    assert len(_shard_files(tmp_path)) > 1
    ours, report = ckpt.load(ckpt.generated_class(model, device, "ForCausalLM"), tmp_path, **load_kwargs)
    theirs, upstream_report = ckpt.load(ckpt.upstream_class(model, "ForCausalLM"), tmp_path, **load_kwargs)
    assert report == upstream_report
    assert report["missing_keys"] == [] and report["mismatched_keys"] == []
    assert {t.dtype for t in ours.state_dict().values()} == {torch.bfloat16}
    _assert_same_tensors(ours, theirs)


@pytest.mark.parametrize("model,device", TARGETS)
def test_upstream_loads_our_sharded_save(model, device, tmp_path):
    _save_upstream(model, tmp_path / "published", dtype=torch.bfloat16)
    ours, _ = ckpt.load(ckpt.generated_class(model, device, "ForCausalLM"), tmp_path / "published", dtype="auto")
    ours.save_pretrained(tmp_path / "ours", max_shard_size="20KB")
    assert len(_shard_files(tmp_path / "ours")) > 1
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(_shard_files(tmp_path / "ours"))
    theirs, report = ckpt.load(ckpt.upstream_class(model, "ForCausalLM"), tmp_path / "ours", dtype="auto")
    assert all(not keys for keys in report.values()), report
    _assert_same_tensors(ours, theirs)
