import pytest
import torch
from patchgen.kernels import ops


@pytest.fixture(autouse=True)
def _float64_cpu_ops(monkeypatch):
    """The torch backends on the CPU target, whatever the machine: the tests compare float64 references."""
    monkeypatch.setenv("PATCHGEN_DEVICE_TARGET", "cpu")
    for slot, backend in {"attention": "eager", "cross_entropy": "eager", "moe_experts": "eager"}.items():
        monkeypatch.setenv(f"PATCHGEN_OPS_{slot.upper()}", backend)
    ops.reset_default()
    torch.set_num_threads(2)
    yield
    ops.reset_default()


@pytest.fixture
def float64_router(monkeypatch):
    """Upstream's MoE router rounds its softmax to float32 even in a float64 model; this one stays
    float64, so MoE flag on vs off can be compared at float64 rounding (the float32 router alone
    differs by ~1e-7)."""
    from tests.models import tiny

    def router(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index

    for device in ("gpu", "npu"):
        monkeypatch.setattr(tiny.module("qwen3_5_moe", device).Qwen3_5MoeTopKRouter, "forward", router)
