"""The npu target picks torch_npu's operators when torch_npu and a device are there, and falls back when not."""

import importlib.util
import sys
from importlib import metadata

import pytest
import torch
from patchgen.kernels import ops, registry
from patchgen.kernels.errors import BackendUnavailable
from patchgen.kernels.selection import resolve, resolve_device_target
from patchgen.kernels.shared_prefix import ATTENTION_NEEDS, check_attention_backend

from tests.models import tiny

without_torch_npu = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here"
)
NPU_BACKENDS = {
    "rms_norm": "npu_rms_norm",
    "rotary": "npu_rotary_mul",
    "swiglu_mlp": "npu_swiglu",
    "attention": "npu_fusion_attention",
    "moe_experts": "npu_grouped_matmul",
}


def test_auto_on_the_npu_target_picks_every_torch_npu_backend(npu):
    table = resolve(None, device_target="npu")
    assert {slot: table.backend(slot) for slot in NPU_BACKENDS} == NPU_BACKENDS


def test_the_npu_target_is_detected_from_torch_npu(npu):
    assert resolve(None).device_target == "npu"


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_npu_modules_default_to_the_torch_npu_backends(npu, model):
    mod = tiny.module(model, "npu")
    table = resolve(tiny.text_config(model), defaults=mod.PATCHGEN_OP_DEFAULTS)
    expected = dict(NPU_BACKENDS) if model == "qwen3_5_moe" else {k: v for k, v in NPU_BACKENDS.items() if k != "moe_experts"}
    assert {slot: table.backend(slot) for slot in expected} == expected
    for slot in expected:
        assert table.choices[slot].why.startswith("device default (npu)")


def test_the_attention_backend_serves_shared_prefix_rows(npu):
    """sparse_mode=3 aligns causal masks bottom-right, which the compact row's suffix segments need."""
    handle = registry.handle("attention", "npu_fusion_attention")
    assert set(ATTENTION_NEEDS) <= handle.capabilities
    check_attention_backend(handle)  # raises BackendUnavailable when a capability is missing


@without_torch_npu
def test_without_torch_npu_the_npu_defaults_fall_back_and_say_why(monkeypatch):
    monkeypatch.delenv("PATCHGEN_DEVICE_TARGET", raising=False)
    registry.reset_all()
    mod = tiny.module("qwen3_5_moe", "npu")
    table = ops.resolve(tiny.text_config("qwen3_5_moe"), device_target="npu", defaults=mod.PATCHGEN_OP_DEFAULTS)
    for slot, backend in NPU_BACKENDS.items():
        assert table.backend(slot) != backend
        assert f"device default {backend!r} unusable here (needs torch-npu" in table.choices[slot].why
    registry.reset_all()


@without_torch_npu
def test_asking_for_a_torch_npu_backend_without_torch_npu_names_the_fix(monkeypatch):
    registry.reset_all()
    with pytest.raises(BackendUnavailable, match=r"npu_fusion_attention.*needs torch-npu>=2.6,<2.15"):
        resolve({"attention": "npu_fusion_attention"}, device_target="npu")
    registry.reset_all()


def test_an_installed_torch_npu_is_imported_to_detect_the_device(monkeypatch, tmp_path):
    """Users need not `import torch_npu` before building a model: detection imports it when installed."""
    (tmp_path / "torch_npu.py").write_text(
        "import torch\nfrom tests.npu import fake_torch_npu\ntorch.npu = fake_torch_npu.device_module()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.delattr(torch, "npu", raising=False)
    fake_versions(monkeypatch, {"torch-npu": "2.14.0"})
    monkeypatch.delenv("PATCHGEN_DEVICE_TARGET", raising=False)
    try:
        assert resolve_device_target() == "npu"
    finally:
        sys.modules.pop("torch_npu", None)
        if hasattr(torch, "npu"):
            delattr(torch, "npu")


def test_triton_ascend_serves_our_triton_kernels(monkeypatch):
    fake_versions(monkeypatch, {"triton-ascend": "3.2.0"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.triton_ready() is None
    fake_versions(monkeypatch, {})
    assert "on an Ascend NPU, needs triton-ascend>=3.2 instead" in registry.triton_ready()


def fake_versions(monkeypatch, versions):
    real = metadata.version

    def version(name):
        if name in versions:
            return versions[name]
        if name in ("torch-npu", "triton", "triton-ascend"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
