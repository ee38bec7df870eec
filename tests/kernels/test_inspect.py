"""Looking at what a model will run changes nothing (issue 14, item 7)."""

import pytest
from patchgen.kernels import ops, registry


@pytest.fixture
def gpu_module_model(monkeypatch):
    """A tiny model of the gpu module, whose device default for moe_experts is grouped_mm."""
    for slot in registry.SLOTS:
        monkeypatch.delenv(f"PATCHGEN_OPS_{slot.upper()}", raising=False)
    monkeypatch.setenv("PATCHGEN_DEVICE_TARGET", "cpu")
    if not registry.handle("moe_experts", "grouped_mm").available:
        pytest.skip("torch has no grouped_mm here")
    from tests.models import tiny

    return tiny.build("qwen3_5_moe", "gpu")


def test_describe_changes_neither_the_table_nor_any_choice(gpu_module_model):
    before = ops.of(gpu_module_model)
    picks = {slot: before.backend(slot) for slot in registry.SLOTS}
    assert "moe_experts" in ops.describe(gpu_module_model)
    after = ops.of(gpu_module_model)
    assert after is before
    assert all(ops.of(m) is before for m in gpu_module_model.modules())
    assert {slot: after.backend(slot) for slot in registry.SLOTS} == picks


def test_describe_shows_the_device_default_the_model_was_built_with(gpu_module_model):
    text = ops.describe(gpu_module_model)
    line = next(x for x in text.splitlines() if x.startswith("moe_experts "))
    assert line.split()[1] == "grouped_mm" and "device default" in line
    assert text.endswith("(bound at model build)")


def test_describe_of_an_unbound_module_says_it_reads_the_process_default():
    import torch

    assert "not bound: the process default" in ops.describe(torch.nn.Linear(2, 2))
