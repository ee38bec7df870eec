"""Resolution sees the dtype an op is called with: per dtype, cached, explicit choices never replaced."""

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels import registry, selection
from patchgen.kernels.errors import BackendUnavailable
from patchgen.kernels.reference import moe_experts as ref_moe
from patchgen.kernels.selection import resolve


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for slot in registry.SLOTS:
        monkeypatch.delenv(f"PATCHGEN_OPS_{slot.upper()}", raising=False)
    monkeypatch.delenv("PATCHGEN_DEVICE_TARGET", raising=False)


@pytest.fixture
def grouped_mm_here():
    if not registry.handle("moe_experts", "grouped_mm").available:
        pytest.skip("torch has no grouped_mm here")


def moe_inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, generator=gen, dtype=dtype)
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]])
    weights = torch.rand(5, 2, generator=gen, dtype=dtype)
    gate_up = torch.randn(3, 2 * 4, 8, generator=gen, dtype=dtype)
    down = torch.randn(3, 8, 4, generator=gen, dtype=dtype)
    return hidden, index, weights, gate_up, down, F.silu


def test_device_default_is_passed_over_for_a_dtype_it_cannot_compute_in(grouped_mm_here):
    table = resolve(None, "cpu", defaults={"moe_experts": "grouped_mm"})
    assert table.backend("moe_experts") == "grouped_mm"
    args = moe_inputs(torch.float64)
    torch.testing.assert_close(table.moe_experts(*args), ref_moe.eager(*args), rtol=0, atol=0)
    again = table.choice_for("moe_experts", torch.float64)
    assert again.backend == "eager"
    assert again.why.startswith("'grouped_mm' cannot compute in float64")


def test_float32_calls_still_use_the_device_default(grouped_mm_here, monkeypatch):
    table = resolve(None, "cpu", defaults={"moe_experts": "grouped_mm"})
    called = []
    monkeypatch.setattr(ref_moe, "eager", lambda *a: called.append("eager"))
    table.moe_experts(*moe_inputs(torch.float32))
    assert called == [] and table.choice_for("moe_experts", torch.float32).backend == "grouped_mm"


def test_explicit_choice_that_cannot_compute_in_the_dtype_raises_naming_it(grouped_mm_here):
    table = resolve({"moe_experts": "grouped_mm"}, "cpu")
    with pytest.raises(BackendUnavailable, match=r"'grouped_mm' cannot be used: cannot compute in float64.*eager"):
        table.moe_experts(*moe_inputs(torch.float64))


def test_explicit_choice_from_env_is_never_replaced_for_a_dtype(grouped_mm_here, monkeypatch):
    monkeypatch.setenv("PATCHGEN_OPS_MOE_EXPERTS", "grouped_mm")
    with pytest.raises(BackendUnavailable, match="float64"):
        resolve(None, "cpu").moe_experts(*moe_inputs(torch.float64))


def test_a_dtype_is_resolved_once_then_cached(grouped_mm_here, monkeypatch):
    table = resolve(None, "cpu", defaults={"moe_experts": "grouped_mm"})
    calls = []
    real = selection._for_dtype
    monkeypatch.setattr(selection, "_for_dtype", lambda *a: calls.append(a) or real(*a))
    for _ in range(3):
        table.moe_experts(*moe_inputs(torch.float64))
    assert len(calls) == 1


def test_backend_serving_every_dtype_is_called_directly():
    table = resolve({"moe_experts": "eager"}, "cpu")
    assert table.moe_experts is ref_moe.eager


def test_flash_attention_handles_serve_half_precision_only():
    for name in ("flash_attention_2", "flash_attention_3", "flash_attention_4", "torch_varlen"):
        handle = registry.handle("attention", name)
        assert handle.serves(torch.bfloat16) and not handle.serves(torch.float32), name


def test_describe_lists_slots_resolved_again_for_a_dtype(grouped_mm_here):
    table = resolve(None, "cpu", defaults={"moe_experts": "grouped_mm"})
    table.moe_experts(*moe_inputs(torch.float64))
    line = next(x for x in table.describe().splitlines() if x.startswith("moe_experts [float64]"))
    assert line.split()[2] == "eager"


def test_device_default_lacking_a_required_capability_falls_back_to_auto(grouped_mm_here):
    table = resolve(None, "cpu", defaults={"moe_experts": "grouped_mm"}, require={"moe_experts": {"float64"}})
    choice = table.choices["moe_experts"]
    assert choice.backend == "eager"
    assert choice.why.startswith("device default 'grouped_mm' unusable here (lacks ['float64'])")


def test_shared_prefix_stages_follow_the_dtype_before_the_slot_is_ever_called():
    """The shared-prefix conv and GDN ask the slot for the stages of the backend that serves a dtype; a
    dtype resolved again (float64 on the npu defaults) must give that backend's stages on the first
    layer too, not nothing (which took the gathered conv on layer 1 and the look-back on later layers)."""
    from patchgen.kernels.reference import causal_conv1d as ref_conv
    from patchgen.kernels.shared_prefix.conv import look_back_kernels
    from patchgen.kernels.shared_prefix.gdn_rounds import round_kernels
    from patchgen.kernels.triton import causal_conv1d, gated_delta_rule

    table = resolve(None, "npu", defaults={"causal_conv1d": "triton", "gated_delta_rule": "triton"})
    if table.backend("causal_conv1d") != "triton":
        pytest.skip(f"our Triton kernels cannot run here: {table.choices['causal_conv1d'].why}")
    assert look_back_kernels(table.causal_conv1d, torch.float32) is causal_conv1d.look_back
    assert round_kernels(table.gated_delta_rule, torch.float32) is gated_delta_rule.rounds
    assert look_back_kernels(table.causal_conv1d, torch.float64) is ref_conv.causal_conv1d.look_back
    assert round_kernels(table.gated_delta_rule, torch.float64) is None  # the reference has no stages: the loop
