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
    """The op call graphs' own capture (no tape), through `CallGraphs.run`: a pass on a new plan whose rows need a
    kernel not loaded yet (a block size that follows the rows, as fla's norms' `NB` does) drops its first call's
    capture quietly (torch would warn that the empty capture was made on the wrong stream), runs that call eagerly and
    leaves the rest eager (two calls left do not repay a capture); the graphs stay on, the next pass captures at its
    first call, and every output is the eager one."""
    from patchgen.kernels.shared_prefix.call_graphs import CallGraphs

    graphs = CallGraphs(enabled=True)

    def body(x):
        y = torch.empty_like(x)
        _launch(x.view(-1), y.view(-1), 2048 if x.shape[1] > 500 else 1024)  # blocks not launched with before
        return y

    class Index:
        """A plan's part the op reads (keyed by identity)."""

    def forward(rows: int) -> list[torch.Tensor]:
        index, outs = Index(), []
        for layer in range(3):
            x = torch.randn(1, rows, 8, device="cuda") + layer
            out = graphs.run("scaled", index, ("scaled",), body, [x])
            outs.append(torch.equal(body(x) if out is None else out, x * 2))
        return outs

    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert forward(125) == [True] * 3  # eager, captured, replayed
        assert (graphs.captures, graphs.not_warm) == (1, 0)
        assert forward(625) == [True] * 3  # its first call's capture meets the 2048-block kernel: all eager
        assert (graphs.captures, graphs.not_warm) == (1, 1) and graphs.enabled
        # warm: captured at its first call (5016 elements, like 1000 and 5000 not a multiple of 16: Triton's
        # specialisation of `n` is the same)
        assert forward(627) == [True] * 3
        assert (graphs.captures, graphs.not_warm) == (2, 1)
    torch.cuda.synchronize()
    assert not [w for w in seen if "CUDA Graph is empty" in str(w.message)], [str(w.message) for w in seen]
    graphs.release()
