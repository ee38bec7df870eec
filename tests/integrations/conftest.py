import pytest
import torch
from patchgen.kernels import ops


@pytest.fixture(autouse=True)
def _float64_cpu_ops(monkeypatch):
    """The torch backends on the CPU target: trainer tests compare float64 runs."""
    monkeypatch.setenv("PATCHGEN_DEVICE_TARGET", "cpu")
    for slot, backend in {"attention": "eager", "cross_entropy": "eager", "moe_experts": "eager"}.items():
        monkeypatch.setenv(f"PATCHGEN_OPS_{slot.upper()}", backend)
    monkeypatch.setenv("WANDB_DISABLED", "true")
    ops.reset_default()
    torch.set_num_threads(2)
    yield
    ops.reset_default()


# MoE flag on vs off at float64 rounding needs the float64 router of the model tests.
from tests.models.conftest import float64_router  # noqa: F401
