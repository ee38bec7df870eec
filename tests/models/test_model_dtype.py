"""A generated model runs in the dtype it is cast to after its ops were bound (issue 14, item 1)."""

import pytest
import torch
from patchgen.kernels import registry

from tests.models import tiny


@pytest.fixture
def gpu_defaults_on_cpu(monkeypatch):
    """The gpu module's own device defaults (grouped_mm experts), not the float64 test overrides."""
    for slot in registry.SLOTS:
        monkeypatch.delenv(f"PATCHGEN_OPS_{slot.upper()}", raising=False)
    if not registry.handle("moe_experts", "grouped_mm").available:
        pytest.skip("torch has no grouped_mm here")


def loss_of(net):
    ids = torch.randint(0, tiny.VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    return net(input_ids=ids, labels=ids).loss


def test_float64_moe_model_of_the_gpu_module_runs(gpu_defaults_on_cpu):
    net = tiny.build("qwen3_5_moe", "gpu")
    loss = loss_of(net)
    assert torch.isfinite(loss)


def test_moe_model_cast_after_build_runs_in_both_dtypes(gpu_defaults_on_cpu):
    mod = tiny.module("qwen3_5_moe", "gpu")
    net = mod.Qwen3_5MoeForCausalLM(tiny.text_config("qwen3_5_moe"))
    tiny.randomize(net)
    first = loss_of(net)
    again = loss_of(net.double())
    torch.testing.assert_close(again.float(), first, rtol=1e-4, atol=1e-4)
