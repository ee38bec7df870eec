"""Kernel handles: cached availability, version bounds from metadata, lazy loading."""

import subprocess
import sys
from importlib import metadata

import pytest
from patchgen.kernels import capabilities as caps
from patchgen.kernels.errors import BackendUnavailable
from patchgen.kernels.handles import KernelHandle, Requirement


def fake_versions(monkeypatch, versions):
    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(metadata, "version", version)


def test_failing_load_is_attempted_once_until_reset():
    calls = []

    def loader():
        calls.append(1)
        raise ImportError("no module named fancy_kernels")

    handle = KernelHandle("rms_norm", "fancy", loader)
    assert not handle.available
    assert not handle.available
    assert handle.reason == "loading failed with ImportError: no module named fancy_kernels"
    with pytest.raises(BackendUnavailable):
        handle.load()
    assert len(calls) == 1
    handle.reset()
    assert not handle.available
    assert len(calls) == 2


def test_successful_load_is_cached_and_returns_the_entry_point():
    calls = []

    def fn():
        return "ran"

    def loader():
        calls.append(1)
        return fn

    handle = KernelHandle("rms_norm", "fancy", loader)
    assert handle.available and handle.reason is None
    assert handle.load() is fn and handle.load()() == "ran"
    assert len(calls) == 1


def test_string_entry_point_is_imported_on_first_use():
    handle = KernelHandle("rms_norm", "torch", "patchgen.kernels.reference.norms:rms_norm")
    from patchgen.kernels.reference.norms import rms_norm

    assert handle.load() is rms_norm


def test_wrong_version_names_the_bounds_and_what_was_found(monkeypatch):
    fake_versions(monkeypatch, {"fla-core": "0.5.0"})
    handle = KernelHandle(
        "gated_delta_rule", "fla", lambda: None, requires=(Requirement("fla-core", ">=0.6,<0.7"),)
    )
    assert not handle.available
    assert handle.reason == "needs fla-core>=0.6,<0.7, found 0.5.0"


def test_missing_distribution_says_not_installed_and_how_to_install(monkeypatch):
    fake_versions(monkeypatch, {})
    handle = KernelHandle(
        "rms_norm", "liger", lambda: None, requires=(Requirement("liger-kernel", ">=0.8,<0.9"),)
    )
    assert (
        handle.reason == "needs liger-kernel>=0.8,<0.9, not installed (pip install 'liger-kernel>=0.8,<0.9')"
    )


def test_version_check_does_not_import_the_library(monkeypatch):
    fake_versions(monkeypatch, {"fla-core": "0.5.0"})
    loaded = []
    handle = KernelHandle(
        "causal_conv1d", "fla", lambda: loaded.append(1), requires=(Requirement("fla-core", ">=0.6"),)
    )
    assert not handle.available
    assert loaded == []


def test_satisfied_bounds_let_the_load_run(monkeypatch):
    fake_versions(monkeypatch, {"fla-core": "0.6.0"})
    handle = KernelHandle(
        "causal_conv1d", "fla", lambda: len, requires=(Requirement("fla-core", ">=0.6,<0.7"),)
    )
    assert handle.available


def test_prerelease_inside_bounds_is_accepted(monkeypatch):
    fake_versions(monkeypatch, {"flash-attn-4": "4.0.0b9"})
    assert Requirement("flash-attn-4", ">=4.0.0b1").problem() is None


def test_needs_gpu_handle_is_unavailable_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    handle = KernelHandle("attention", "flash", lambda: len, capabilities={caps.NEEDS_GPU, caps.VARLEN})
    assert handle.needs_gpu
    assert handle.reason == "needs a CUDA device, none is visible"


def test_extra_check_reason_is_reported():
    handle = KernelHandle("rms_norm", "npu_only", lambda: len, check=lambda: "needs an NPU")
    assert handle.reason == "needs an NPU"


def test_unknown_capability_is_rejected():
    with pytest.raises(ValueError, match="unknown capabilities"):
        KernelHandle("rms_norm", "x", lambda: len, capabilities={"teleport"})


def test_importing_the_kernel_layer_loads_no_kernel_library():
    code = (
        "import sys, patchgen.kernels.ops, patchgen.kernels.selection, patchgen.kernels.registry;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('fla', 'liger_kernel', 'flash_attn', "
        "'flash_attn_interface', 'triton') or m.startswith('patchgen.kernels.backends')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_setting_error_while_loading_is_raised_not_taken_for_an_unavailable_backend():
    # A misspelt PATCHGEN_TRITON_CONV raised SettingError inside the backend's import; the handle cached it
    # as "unavailable" and `auto` or a device default silently ran the next backend (the npu target's GDN,
    # conv and gated norm all fell back to the torch references).
    from patchgen.kernels.errors import SettingError

    calls = []

    def loader():
        calls.append(1)
        raise SettingError("PATCHGEN_TRITON_CONV='windw': unknown causal_conv1d launch preset 'windw'")

    handle = KernelHandle("causal_conv1d", "fancy", loader)
    with pytest.raises(SettingError, match="windw"):
        assert handle.available
    with pytest.raises(SettingError, match="windw"):
        handle.load()
    assert len(calls) == 2  # not cached: the next query, after the setting is fixed, loads again


def test_a_bad_triton_launch_preset_is_refused_at_model_build_under_auto(monkeypatch):
    # The whole route a user takes: the npu module's device default is our Triton conv, resolved at build.
    from patchgen.kernels import registry
    from patchgen.kernels.errors import SettingError
    from patchgen.kernels.selection import resolve

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PATCHGEN_TRITON_CONV", "windw")
    # the handle's entry is the package (patchgen.kernels.triton:causal_conv1d): import it afresh, as a new process
    # would; monkeypatch puts the modules of this process back afterwards
    for name in [name for name in sys.modules if name.startswith("patchgen.kernels.triton")]:
        monkeypatch.delitem(sys.modules, name)
    registry.reset_all()
    try:
        with pytest.raises(SettingError, match="PATCHGEN_TRITON_CONV='windw'"):
            resolve(None, device_target="npu", defaults={"causal_conv1d": "triton"})
    finally:
        monkeypatch.delenv("PATCHGEN_TRITON_CONV")
        registry.reset_all()
