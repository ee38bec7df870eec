"""ops.bind stores one table on every submodule; ops.of reads it or the process default."""

from types import SimpleNamespace

import pytest
import torch
from patchgen.kernels import ops


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("PATCHGEN_OPS_ATTENTION", raising=False)
    ops.reset_default()
    yield
    ops.reset_default()


def model():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.LayerNorm(2)))
    net.config = SimpleNamespace(ops_implementation={"attention": "eager"})
    return net


def test_bind_stores_the_same_table_on_every_submodule():
    net = model()
    table = ops.bind(net, device_target="cpu")
    assert table.backend("attention") == "eager"
    assert all(ops.of(m) is table for m in net.modules())


def test_bound_table_is_not_state():
    net = model()
    before = set(net.state_dict())
    ops.bind(net, device_target="cpu")
    assert set(net.state_dict()) == before
    assert not any("ops" in name for name, _ in net.named_parameters())
    assert not any("ops" in name for name, _ in net.named_buffers())
    assert len(list(net.children())) == 2


def test_explicit_config_overrides_model_config():
    table = ops.bind(model(), {"attention": "sdpa"}, device_target="cpu")
    assert table.backend("attention") == "sdpa"


def test_unbound_module_gets_the_process_default_from_env(monkeypatch):
    monkeypatch.setenv("PATCHGEN_DEVICE_TARGET", "cpu")
    monkeypatch.setenv("PATCHGEN_OPS_ATTENTION", "eager")
    table = ops.of(torch.nn.Linear(1, 1))
    assert table.backend("attention") == "eager"
    assert ops.of(torch.nn.ReLU()) is table


def test_bound_model_deepcopies():
    import copy

    net = model()
    table = ops.bind(net, device_target="cpu")
    assert ops.of(copy.deepcopy(net)) is table
