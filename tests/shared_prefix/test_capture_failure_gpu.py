"""`capture_failure.py` on the GPU: after a CUDA graph capture that raised (inside torch's `capture_begin`, at a
`capture_end` CUDA refused, in the op graphs, in the layer-stack graphs), random ops on the device work and draw
what they would have drawn had the capture never been tried, graphs captured before still replay, the allocator
records to the failed capture's pool no more, and the stream that was current is current again. Skipped without
CUDA."""

import warnings

import pytest
import torch
from patchgen.kernels.errors import GraphCaptureFailed
from patchgen.kernels.shared_prefix.capture_failure import in_capture_mode, restore_after_failed_capture

pytestmark = pytest.mark.gpu

TORCH_ARMS_EARLY = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


@pytest.fixture(autouse=True)
def _device_put_back():
    """A test that fails between a capture that raised and its mend would leave the generator in capture mode for
    every later test of its worker."""
    yield
    restore_after_failed_capture(torch.device("cuda"))


def _generator():
    return torch.cuda.default_generators[torch.cuda.current_device()]


def _next_draws(generator) -> torch.Tensor:
    """What the next eager draw on the device gives, the generator left as it was."""
    state = generator.get_state()
    draws = torch.rand(64, device="cuda")
    generator.set_state(state)
    return draws


def _captured(body, pool=None):
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        out = body()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def test_a_capture_refused_inside_capture_begin_leaves_the_generator_drawing_what_it_would_have_drawn():
    torch.cuda.manual_seed(1234)
    earlier, noise = _captured(lambda: torch.rand(16, device="cuda"))  # a graph with a random op, from before
    generator = _generator()
    expected = _next_draws(generator)
    failed = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        failed.capture_begin()  # on the default stream: refused after torch armed the generator
    assert in_capture_mode(generator, torch.device("cuda")) or not TORCH_ARMS_EARLY
    restore_after_failed_capture(torch.device("cuda"))
    assert not in_capture_mode(generator, torch.device("cuda"))
    assert torch.equal(torch.rand(64, device="cuda"), expected)
    earlier.replay()  # shares the mended generator
    first = noise.clone()
    earlier.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, noise)  # each replay draws anew


def test_a_capture_end_that_cuda_refused_leaves_its_pool_unrecorded_and_the_generator_working():
    generator = _generator()
    expected = _next_draws(generator)
    pool = torch.cuda.graph_pool_handle()
    failed, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        failed.capture_begin(pool=pool, capture_error_mode="thread_local")
        x = torch.ones(8, device="cuda")
        with pytest.raises(RuntimeError):
            x.sum().item()  # a sync: CUDA invalidates the capture
        with pytest.raises(RuntimeError):
            failed.capture_end()  # refused before it stops the allocator recording to the pool
    del x
    restore_after_failed_capture(torch.device("cuda"), pool=pool)
    assert torch.equal(torch.rand(64, device="cuda"), expected)
    # the device allocator records to the pool no more: its filter, which reads the failed graph, is gone with it
    with pytest.raises(RuntimeError, match="not currently recording"):
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    # and a capture into a new pool, as the graphs make after a failure, works
    y = torch.zeros(8, device="cuda")
    graph, _ = _captured(lambda: y.add_(1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.ones(8, device="cuda"))


def test_an_op_graph_capture_that_fails_turns_the_graphs_off_and_leaves_sampling_working():
    from patchgen.kernels.shared_prefix.call_graphs import CallGraphs, CallGraphUnavailable

    graphs = CallGraphs(enabled=True)

    class Index:
        """A plan's part the op reads (keyed by identity)."""

    def body(x):  # reads a count on the host, as an op that cannot be captured does
        return x * int(x.abs().sum().item() > 0)

    index, stream = Index(), torch.cuda.current_stream()
    with torch.no_grad():
        x = torch.randn(1, 64, 8, device="cuda")
        assert graphs.run("syncs", index, ("syncs",), body, [x]) is None  # the first call: eager
        expected = _next_draws(_generator())
        with pytest.warns(CallGraphUnavailable, match="could not be captured"):
            assert graphs.run("syncs", index, ("syncs",), body, [x]) is None  # the capture fails: eager
    assert not graphs.enabled
    assert torch.cuda.current_stream() == stream
    assert torch.equal(torch.rand(64, device="cuda"), expected)
    probs = torch.softmax(torch.randn(4, 100, device="cuda"), -1)
    assert torch.multinomial(probs, 1).shape == (4, 1)  # sampling, as generation does
    graphs.release()


@pytest.mark.parametrize("training", [True, False])
def test_a_layer_stack_capture_that_fails_raises_with_the_device_as_it_was(training):
    from patchgen.kernels.graphs import StaticCall
    from patchgen.kernels.graphs.replay import CudaGraphReplay, CudaGraphScoring

    weight = torch.randn(32, 32, device="cuda", requires_grad=training)

    def layers(hidden, position_embeddings, masks):
        out = hidden @ weight
        return out * int(out.abs().sum().item() > 0)  # a sync: fine eagerly (the warm-ups), fatal to a capture

    hidden = torch.randn(4, 32, device="cuda", requires_grad=training)
    static = StaticCall.of(hidden, (), {}, {})
    stream = torch.cuda.current_stream()
    expected = _next_draws(_generator())
    with warnings.catch_warnings(), pytest.raises(GraphCaptureFailed, match="capturing the decoder-layer stack failed"):
        warnings.simplefilter("ignore")  # torch's own warnings about the invalidated capture
        if training:
            CudaGraphReplay(layers, static, [weight])
        else:
            with torch.no_grad():
                CudaGraphScoring(layers, static)
    assert torch.cuda.current_stream() == stream
    assert torch.equal(torch.rand(64, device="cuda"), expected)
    assert torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5).count_nonzero() > 0
