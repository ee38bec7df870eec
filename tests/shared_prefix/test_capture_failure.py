"""`capture_failure.py` without a device: what it does when the device cannot even be looked at. Its work on the GPU
is `test_capture_failure_gpu.py`'s."""

import contextlib
import warnings

import pytest
import torch
from patchgen.kernels.shared_prefix import capture_failure


def _out_of_memory(generator, device):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")


@pytest.fixture
def device_that_cannot_draw(monkeypatch):
    """A device whose probe draw fails as on a device a failed capture left full: the allocator has no block left."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "default_generators", (torch.Generator(),))
    monkeypatch.setattr(capture_failure, "in_capture_mode", _out_of_memory)
    return torch.device("cuda", 0)


def test_a_generator_that_cannot_be_looked_at_is_a_warning_not_an_error_in_place_of_the_capture_s(device_that_cannot_draw):
    # the caller raises the capture's own error (the layer-stack graphs) or goes on eagerly (the op graphs): an error
    # of the mend would take its place
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture_failure.restore_after_failed_capture(device_that_cannot_draw, off="set X=0")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("out of memory" in m and "set X=0" in m for m in messages), messages
