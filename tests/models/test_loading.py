"""Checkpoints saved by upstream's classes load into every generated class exactly as into upstream's."""

import json

import pytest
import torch
from patchgen.kernels.errors import MissingWeights
from safetensors.torch import load_file, save_file

from tests.models import checkpoints as ckpt
from tests.models import tiny

TARGETS = sorted(tiny.MODULES)
CASES = [(layout, dest) for layout in ckpt.LAYOUTS for dest in ckpt.DESTINATIONS[layout]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per (model, layout), saved by upstream's class."""
    paths = {}
    for model in ("qwen3_5", "qwen3_5_moe"):
        for layout in ckpt.LAYOUTS:
            path = tmp_path_factory.mktemp(f"{model}_{layout}")
            ckpt.save_upstream(model, layout, path)
            paths[model, layout] = path
    return paths


def _logits(net, ids):
    with torch.no_grad():
        return net(input_ids=ids).logits


@pytest.mark.parametrize("layout,dest", CASES)
@pytest.mark.parametrize("model,device", TARGETS)
def test_checkpoint_loads_every_tensor_with_upstreams_report_and_logits(model, device, layout, dest, saved):
    ours, report = ckpt.load(ckpt.generated_class(model, device, dest), saved[model, layout])
    theirs, upstream_report = ckpt.load(ckpt.upstream_class(model, dest), saved[model, layout])
    assert report == upstream_report
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    if dest.startswith("For"):  # the classes one trains: nothing may be left random
        assert report["missing_keys"] == [] and report["unexpected_keys"] == [] and report["mismatched_keys"] == []
        ids = ckpt.ids()
        # float32 on CPU: the op-slot references and upstream's fallbacks round differently (float64
        # parity to 1e-12 is tests/models/test_upstream_parity.py); random weights would be off by O(1).
        torch.testing.assert_close(_logits(ours, ids), _logits(theirs, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ckpt.LAYOUTS)
@pytest.mark.parametrize("model,device", TARGETS)
def test_save_pretrained_writes_what_upstream_writes(model, device, layout, saved, tmp_path):
    ours, _ = ckpt.load(ckpt.generated_class(model, device, layout), saved[model, layout])
    theirs, _ = ckpt.load(ckpt.upstream_class(model, layout), saved[model, layout])
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    ours_tensors = load_file(tmp_path / "ours" / "model.safetensors")
    theirs_tensors = load_file(tmp_path / "theirs" / "model.safetensors")
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    for name, tensor in theirs_tensors.items():
        assert torch.equal(ours_tensors[name], tensor), name
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config == json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert "auto_map" not in config


@pytest.mark.parametrize("layout", ckpt.LAYOUTS)
@pytest.mark.parametrize("model,device", TARGETS)
def test_upstream_loads_what_we_save(model, device, layout, saved, tmp_path):
    ours, _ = ckpt.load(ckpt.generated_class(model, device, layout), saved[model, layout])
    ours.save_pretrained(tmp_path)
    theirs, report = ckpt.load(ckpt.upstream_class(model, layout), tmp_path)
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[name], tensor), name


@pytest.mark.parametrize("model,device", TARGETS)
def test_missing_and_stray_tensors_are_reported_as_upstream_reports_them(model, device, saved, tmp_path):
    tensors = load_file(saved[model, "ForConditionalGeneration"] / "model.safetensors")
    dropped = next(name for name in tensors if "layers.1." in name and "language_model" in name)
    del tensors[dropped]
    tensors["model.language_model.layers.0.stray.weight"] = torch.zeros(2)
    for path in saved[model, "ForConditionalGeneration"].iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for dest in ("ForCausalLM", "ForConditionalGeneration"):
        # a weight the checkpoint lacks would be random: refused, naming it, unless asked for
        with pytest.raises(MissingWeights, match=r"1 weight\(s\) .* randomly initialised: .*layers\.1\.") as raised:
            ckpt.load(ckpt.generated_class(model, device, dest), tmp_path)
        assert "allow_missing_weights=True" in str(raised.value)
        _, report = ckpt.load(ckpt.generated_class(model, device, dest), tmp_path, allow_missing_weights=True)
        _, upstream_report = ckpt.load(ckpt.upstream_class(model, dest), tmp_path)
        assert report == upstream_report
        assert report["missing_keys"] and report["unexpected_keys"]


@pytest.mark.parametrize("model,device", TARGETS)
def test_a_checkpoint_of_another_shape_is_refused_as_upstream_refuses_it(model, device, saved, tmp_path):
    path = saved[model, "ForCausalLM"]
    for name in ("model.safetensors", "generation_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = tiny.VOCAB + 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    errors = []
    for cls in (ckpt.generated_class(model, device, "ForCausalLM"), ckpt.upstream_class(model, "ForCausalLM")):
        with pytest.raises(RuntimeError) as raised:
            cls.from_pretrained(tmp_path)
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and "ignore_mismatched_sizes" in errors[0]
    _, report = ckpt.load(ckpt.generated_class(model, device, "ForCausalLM"), tmp_path, ignore_mismatched_sizes=True)
    _, upstream_report = ckpt.load(ckpt.upstream_class(model, "ForCausalLM"), tmp_path, ignore_mismatched_sizes=True)
    assert report == upstream_report and report["mismatched_keys"]


@pytest.mark.parametrize(
    "layout,dest",
    [
        ("ForConditionalGeneration", "ForSequenceClassification"),
        ("ForConditionalGeneration", "ForTokenClassification"),
        ("ForCausalLM", "TextForSequenceClassification"),
    ],
)
@pytest.mark.parametrize("device", ["gpu", "npu"], ids=["gpu-target", "npu-target"])
def test_classification_heads_load_the_backbone_and_report_the_new_head_as_upstream(device, layout, dest, saved):
    ours, report = ckpt.load(ckpt.generated_class("qwen3_5", device, dest), saved["qwen3_5", layout], num_labels=3)
    theirs, upstream_report = ckpt.load(ckpt.upstream_class("qwen3_5", dest), saved["qwen3_5", layout], num_labels=3)
    assert report == upstream_report and report["missing_keys"]  # the new head, as upstream reports it
    for name, tensor in theirs.state_dict().items():
        if name not in report["missing_keys"]:
            assert torch.equal(ours.state_dict()[name], tensor), name
    # transformers' generic heads build their backbone with AutoModel, upstream's model: ours is this module's, so
    # the op slots' kernels (and a packed row, shared prefixes) serve it too
    module = ckpt.generated_class("qwen3_5", device, dest).__module__
    backbone = ours.model.language_model if dest != "TextForSequenceClassification" else ours.model
    assert type(ours.model).__module__ == module and type(backbone).__module__ == module
    ours.load_state_dict(theirs.state_dict())  # the new head, randomly initialised, as upstream's
    ids = ckpt.ids()[:1]  # a sequence head pools at the last token: more rows want a pad token
    torch.testing.assert_close(_logits(ours, ids), _logits(theirs, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model,device", TARGETS)
def test_a_text_class_ties_the_lm_head_as_the_composite_checkpoint_did(model, device, tmp_path):
    """A published-layout checkpoint whose composite config ties the embeddings holds no lm_head.weight, and
    its text section says false (the text config's default): upstream's ForCausalLM leaves that head random."""
    torch.manual_seed(0)
    config = ckpt.vl_config(model)
    config.tie_word_embeddings = True
    saved = ckpt.upstream_class(model, "ForConditionalGeneration")(config)
    tiny.randomize(saved, 0)
    saved.save_pretrained(tmp_path)
    net, report = ckpt.load(ckpt.generated_class(model, device, "ForCausalLM"), tmp_path)
    assert report["missing_keys"] == []
    assert net.lm_head.weight.data_ptr() == net.model.embed_tokens.weight.data_ptr()
    ids = ckpt.ids()
    torch.testing.assert_close(_logits(net, ids), _logits(saved.eval(), ids), rtol=0, atol=1e-5)
    _, upstream_report = ckpt.load(ckpt.upstream_class(model, "ForCausalLM"), tmp_path)
    assert upstream_report["missing_keys"] == ["lm_head.weight"]  # what this guards against


@pytest.mark.parametrize("model,device", TARGETS)
def test_a_composite_config_object_given_to_a_text_class_ties_as_it_says(model, device, tmp_path):
    config = ckpt.vl_config(model)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    ckpt.upstream_class(model, "ForConditionalGeneration")(config).save_pretrained(tmp_path)
    net, report = ckpt.load(ckpt.generated_class(model, device, "ForCausalLM"), tmp_path, config=config)
    assert report["missing_keys"] == [] and net.config.tie_word_embeddings is True
    assert net.lm_head.weight.data_ptr() == net.model.embed_tokens.weight.data_ptr()
