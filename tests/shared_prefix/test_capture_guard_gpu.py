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


def test_a_call_graphs_first_call_capture_that_meets_a_new_kernel_runs_eagerly_without_a_misleading_warning():
    """The op call graphs' own capture (no tape): dropped quietly (torch would warn that the empty capture was made
    on the wrong stream), counted, and the graphs stay on."""
    from patchgen.kernels.shared_prefix.call_graphs import CallGraphs

    graphs = CallGraphs(enabled=True)
    x = torch.randn(5000, device="cuda")
    block = 512  # not launched with before in this process

    def body(x):
        y = torch.empty_like(x)
        _launch(x, y, block)
        return y

    class Index:
        """The plan's part the op reads (keyed by identity)."""

    index = Index()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        entry = graphs._capture_or_give_up(("key",), index, body, [x], first=True)
    torch.cuda.synchronize()
    assert entry is None and graphs.not_warm == 1 and graphs.enabled
    assert not [w for w in seen if "CUDA Graph is empty" in str(w.message)], [str(w.message) for w in seen]
    assert torch.equal(body(x), x * 2)  # eagerly: loaded and run
    entry = graphs._capture_or_give_up(("key",), index, body, [x], first=True)  # warm now: captured
    x.mul_(-1)
    entry.statics[0].copy_(x)
    entry.graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(entry.out, x * 2)
    del entry  # the graph before its pool
    graphs.release()
