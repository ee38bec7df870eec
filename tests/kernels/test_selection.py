"""Selection order, device targets, capability requirements and BackendUnavailable messages."""

import copy
import pickle
from dataclasses import fields
from types import SimpleNamespace

import pytest
from patchgen.kernels import registry
from patchgen.kernels.config import OpsImplementationConfig
from patchgen.kernels.errors import BackendUnavailable
from patchgen.kernels.handles import KernelHandle
from patchgen.kernels.selection import AUTO_ORDER, resolve, resolve_device_target


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for slot in registry.SLOTS:
        monkeypatch.delenv(f"PATCHGEN_OPS_{slot.upper()}", raising=False)
    monkeypatch.delenv("PATCHGEN_DEVICE_TARGET", raising=False)


@pytest.fixture
def fake_gdn(monkeypatch):
    """Adds an always-available 'fake' GDN backend (first in every auto order) and an unavailable 'broken' one."""
    from patchgen.kernels.reference.gated_delta_rule import gated_delta_rule

    fake = KernelHandle("gated_delta_rule", "fake", lambda: gated_delta_rule, capabilities={"varlen"})
    broken = KernelHandle("gated_delta_rule", "broken", lambda: 1 / 0)
    monkeypatch.setitem(
        registry.BACKENDS, "gated_delta_rule", (fake, broken) + registry.BACKENDS["gated_delta_rule"]
    )
    for target in AUTO_ORDER:
        order = AUTO_ORDER[target]["gated_delta_rule"]
        monkeypatch.setitem(AUTO_ORDER[target], "gated_delta_rule", ("broken", "fake") + order)
    return fake


def test_config_fields_are_exactly_the_slots():
    assert tuple(f.name for f in fields(OpsImplementationConfig)) == registry.SLOTS


def test_auto_on_cpu_picks_the_torch_references():
    table = resolve(None, device_target="cpu")
    assert {slot: table.backend(slot) for slot in registry.SLOTS} == {
        "gated_delta_rule": "torch",
        "causal_conv1d": "torch",
        "rms_norm_gated": "torch",
        "rms_norm": "torch",
        "rotary": "torch",
        "swiglu_mlp": "torch",
        "attention": "sdpa",
        "cross_entropy": "chunked",
        "moe_experts": "eager",
    }


def test_auto_on_gpu_target_without_gpu_libraries_falls_back_and_says_why(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    registry.reset_all()
    try:
        table = resolve(None, device_target="gpu")
        assert table.backend("gated_delta_rule") in ("triton", "torch")
        assert table.backend("attention") == "sdpa"
        why = table.choices["attention"].why
        assert why.startswith("auto (gpu); skipped flash_attention_3: ")
    finally:
        registry.reset_all()


def test_auto_skips_unavailable_backends(fake_gdn):
    assert resolve(None, device_target="cpu").handle("gated_delta_rule") is fake_gdn


def test_env_beats_auto(monkeypatch, fake_gdn):
    monkeypatch.setenv("PATCHGEN_OPS_GATED_DELTA_RULE", "torch")
    table = resolve(None, device_target="cpu")
    assert table.backend("gated_delta_rule") == "torch"
    assert table.choices["gated_delta_rule"].why == "env PATCHGEN_OPS_GATED_DELTA_RULE=torch"


def test_config_beats_env(monkeypatch, fake_gdn):
    monkeypatch.setenv("PATCHGEN_OPS_GATED_DELTA_RULE", "torch")
    table = resolve({"gated_delta_rule": "fake"}, device_target="cpu")
    assert table.backend("gated_delta_rule") == "fake"
    assert table.choices["gated_delta_rule"].why == "config ops_implementation.gated_delta_rule='fake'"


def test_env_beats_device_default_which_beats_auto(monkeypatch, fake_gdn):
    assert resolve(None, "cpu", defaults={"gated_delta_rule": "torch"}).backend("gated_delta_rule") == "torch"
    monkeypatch.setenv("PATCHGEN_OPS_GATED_DELTA_RULE", "fake")
    assert resolve(None, "cpu", defaults={"gated_delta_rule": "torch"}).backend("gated_delta_rule") == "fake"


def test_unusable_device_default_falls_back_to_auto_saying_why(fake_gdn):
    # A GPU module's default (fla) on a machine without it: auto runs, and the table says why.
    choice = resolve(None, "cpu", defaults={"gated_delta_rule": "fla"}).choices["gated_delta_rule"]
    assert choice.backend == "fake"
    assert choice.why.startswith("device default 'fla' unusable here (")
    assert "); auto (cpu)" in choice.why


def test_device_default_naming_no_backend_is_a_config_bug():
    with pytest.raises(ValueError, match="device default gated_delta_rule='nope' names no backend"):
        resolve(None, "cpu", defaults={"gated_delta_rule": "nope"})


def test_env_auto_means_no_choice(monkeypatch, fake_gdn):
    monkeypatch.setenv("PATCHGEN_OPS_GATED_DELTA_RULE", "auto")
    assert resolve(None, "cpu").backend("gated_delta_rule") == "fake"


def test_config_read_from_model_config_and_its_text_config():
    direct = SimpleNamespace(ops_implementation={"attention": "eager"})
    nested = SimpleNamespace(
        text_config=SimpleNamespace(ops_implementation=OpsImplementationConfig(attention="eager"))
    )
    assert resolve(direct, "cpu").backend("attention") == "eager"
    assert resolve(nested, "cpu").backend("attention") == "eager"


def test_config_naming_an_unknown_slot_is_an_error():
    with pytest.raises(ValueError, match="unknown op slots \\['atention'\\]"):
        resolve({"atention": "eager"}, "cpu")


def test_device_target_from_env_and_argument(monkeypatch):
    monkeypatch.setenv("PATCHGEN_DEVICE_TARGET", "npu")
    assert resolve_device_target() == "npu"
    assert resolve_device_target("cpu") == "cpu"
    with pytest.raises(ValueError, match="device target must be one of"):
        resolve_device_target("tpu")


def test_unavailable_backend_names_slot_reason_and_working_backends(fake_gdn):
    with pytest.raises(BackendUnavailable) as info:
        resolve({"gated_delta_rule": "broken"}, "cpu")
    error = info.value
    assert (error.slot, error.backend) == ("gated_delta_rule", "broken")
    assert error.reason == "loading failed with ZeroDivisionError: division by zero"
    assert "fake" in error.working and "torch" in error.working and "broken" not in error.working
    assert str(error).startswith(
        "op slot 'gated_delta_rule': backend 'broken' cannot be used: loading failed"
    )
    assert "Backends that would work: fake, " in str(error)


def test_missing_capability_raises_naming_backends_that_have_it(fake_gdn):
    with pytest.raises(BackendUnavailable) as info:
        resolve(
            {"gated_delta_rule": "fake"},
            "cpu",
            require={"gated_delta_rule": {"varlen", "initial_state_grad"}},
        )
    assert info.value.reason == "lacks required capabilities ['initial_state_grad']"
    assert "torch" in info.value.working and "fake" not in info.value.working


def test_auto_honours_required_capabilities(fake_gdn):
    table = resolve(None, "cpu", require={"gated_delta_rule": {"initial_state_grad"}})
    assert table.backend("gated_delta_rule") == "torch"
    assert "fake: lacks ['initial_state_grad']" in table.choices["gated_delta_rule"].why


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(BackendUnavailable, match="no such backend \\(known: .*sdpa, eager\\)"):
        resolve({"attention": "flash"}, "cpu")


def test_triton_backend_unavailable_reports_a_reason(monkeypatch):
    handle = registry.handle("gated_delta_rule", "triton")
    handle.reset()
    try:
        if not handle.available:
            assert handle.reason
    finally:
        handle.reset()


def test_describe_lists_slot_backend_and_why():
    text = resolve({"attention": "eager"}, "cpu").describe()
    assert text.splitlines()[0] == "op slots (device target cpu):"
    assert any(line.split()[:2] == ["attention", "eager"] and "config" in line for line in text.splitlines())


def test_table_slots_call_the_chosen_backend():
    from patchgen.kernels.reference import attention

    table = resolve({"attention": "eager"}, "cpu")
    assert table.attention is attention.eager
    with pytest.raises(AttributeError):
        table.attention = None


def test_table_survives_copy_and_pickle():
    table = resolve({"attention": "eager"}, "cpu")
    assert copy.deepcopy(table) is table
    again = pickle.loads(pickle.dumps(table))
    assert again.backend("attention") == "eager" and again.device_target == "cpu"


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_gpu_gated_norm_defaults_to_one_launch_shape_for_every_row_count(model):
    """fla tunes its gated norm per bucket of row count and its configurations round some rows apart
    (bench/norm_config_bits.py, H200): a shared pass and packed would be bit-equal by luck. Ours is the
    generated GPU modules' default and first in `auto`."""
    import importlib

    generated = importlib.import_module(f"patchgen.generated.{model}.patched_modeling_{model}_gpu")
    assert generated.PATCHGEN_OP_DEFAULTS["rms_norm_gated"] == "triton"
    assert AUTO_ORDER["gpu"]["rms_norm_gated"][0] == "triton"
