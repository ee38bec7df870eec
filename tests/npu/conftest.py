"""``npu``: torch_npu for one test, the fake (tests/npu/fake_torch_npu.py) or, where present, the real one.

The fake goes into ``sys.modules`` with a fake ``torch.npu`` and fake distribution metadata; the
real one runs when it imports and ``torch.npu.is_available()``, and is skipped otherwise, saying
why. Either way every operator call is recorded, and on the way out the kernel-handle verdicts,
the process op table and the imported npu adapters are forgotten, so nothing leaks between tests.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import dataclass, field
from importlib import metadata

import pytest
import torch
from patchgen.kernels import ops, registry

from tests.npu import fake_torch_npu

ADAPTERS = "patchgen.kernels.backends.npu_"
OPERATORS = fake_torch_npu.OPERATORS


@dataclass
class Npu:
    """The torch_npu in use, its device, and the operator calls made through it (name, kwargs-like dict)."""

    module: object
    device: torch.device
    real: bool
    calls: list = field(default_factory=list)

    def called(self, name: str) -> list[dict]:
        return [arguments for op, arguments in self.calls if op == name]


def _real_torch_npu() -> tuple[object | None, str]:
    try:
        real = importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - any import failure means: no real torch_npu here
        return None, f"torch_npu does not import here ({type(exc).__name__}: {exc})"
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return None, "torch_npu imports but no Ascend NPU is available"
    return real, ""


def _recording(name, fn, calls):
    @functools.wraps(fn)
    def record(*args, **kwargs):
        calls.append((name, {"args": args, **kwargs}))
        return fn(*args, **kwargs)

    return record


def _forget_adapters():
    for name in [n for n in sys.modules if n.startswith(ADAPTERS)]:
        del sys.modules[name]
    # transformers caches whether torch_npu is there; the fake must not outlive its test in that cache.
    from transformers.utils import import_utils

    import_utils.is_torch_npu_available.cache_clear()


@pytest.fixture(params=["fake", "real"])
def npu(request, monkeypatch):
    for variable in [v for v in os.environ if v.startswith("PATCHGEN_OPS_")]:
        monkeypatch.delenv(variable)
    monkeypatch.delenv("PATCHGEN_DEVICE_TARGET", raising=False)
    calls: list = []
    if request.param == "real":
        real, why = _real_torch_npu()
        if real is None:
            pytest.skip(why)
        for name in OPERATORS:
            monkeypatch.setattr(real, name, _recording(name, getattr(real, name), calls))
        state = Npu(real, torch.device("npu"), True, calls)
    else:
        if torch.cuda.is_available():
            pytest.skip("the fake NPU is tested on machines without CUDA (CUDA would win device detection)")
        fake = fake_torch_npu.module()
        for name in OPERATORS:
            setattr(fake, name, _recording(name, getattr(fake, name), calls))
        monkeypatch.setitem(sys.modules, "torch_npu", fake)
        monkeypatch.setattr(torch, "npu", fake_torch_npu.device_module(), raising=False)
        real_version = metadata.version

        def version(distribution):
            return fake_torch_npu.VERSION if distribution == "torch-npu" else real_version(distribution)

        monkeypatch.setattr(metadata, "version", version)
        state = Npu(fake, torch.device("cpu"), False, calls)
    _forget_adapters()
    registry.reset_all()
    ops.reset_default()
    yield state
    _forget_adapters()
    registry.reset_all()
    ops.reset_default()
