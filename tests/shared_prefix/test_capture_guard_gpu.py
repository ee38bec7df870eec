"""`capture_guard.py` on the GPU: a Triton kernel first launched under a watched capture is refused before it loads,
the capture ends cleanly, and the device goes on as if it had never been tried. Skipped without CUDA."""

import warnings

import pytest
import torch
from patchgen.kernels.shared_prefix import capture_guard

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _scaled(x, y, n, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(y + offsets, tl.load(x + offsets, mask=keep) * factor, mask=keep)


def _launch(x, y, block):
    _scaled[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), 2.0, BLOCK=block)


def _captured(x, y, block, watched: bool):
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            if watched:
                with capture_guard.no_new_kernels():
                    _launch(x, y, block)
            else:
                _launch(x, y, block)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def test_a_kernel_not_loaded_yet_is_refused_under_a_watched_capture_and_runs_after_it():
    assert capture_guard.available()
    x = torch.randn(3000, device="cuda")
    y = torch.zeros_like(x)
    block = 256  # a constexpr this process has not launched the kernel with: a compile and a load
    with pytest.raises(capture_guard.NotWarm, match="_scaled"):
        _captured(x, y, block, watched=True)
    torch.cuda.synchronize()
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.count_nonzero(y) == 0  # nothing of the dropped capture ran
    _launch(x, y, block)  # eagerly: compiled, loaded, run
    assert torch.equal(y, x * 2)
    # loaded now: a watched capture takes it, and its replay computes
    y.zero_()
    graph = _captured(x, y, block, watched=True)
    x.mul_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)
