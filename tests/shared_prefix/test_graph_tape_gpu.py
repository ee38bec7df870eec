"""A layer captured with its linears left out (`shared_prefix/graph_tape.py`), on the GPU: replayed for a stack of
blocks, every block's output is its eager output bit for bit, on its own weights, which are never copied; under
autocast too; and a block that reads a linear's weight outside F.linear is not captured. Skipped without CUDA."""

import pytest
import torch
from patchgen.kernels.shared_prefix.call_graphs import CallGraphs, CallGraphUnavailable
from torch import nn
from torch.nn import functional as F

from tests.shared_prefix.test_graph_tape_replays import once_in_another_thread

pytestmark = pytest.mark.gpu

WIDTH, ROWS, BLOCKS = 256, 1000, 5
LINEARS = ("q", "k", "up", "down")


class _Block(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.q, self.k = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        h = x * self.scale
        gated = self.q(h) * torch.sigmoid(self.k(h))  # two linears in a row: an empty graph between them
        wide = self.up(gated)
        # q again, on a strided slice (its rows fold into one mm without a copy, as matmul folds them)
        return x + self.down(F.silu(wide)) + self.q(wide[..., :WIDTH])


class _ReadsItsWeight(_Block):
    def forward(self, x):
        return x + (x * self.scale) @ self.q.weight.t()  # not through F.linear: a replay would read block 1's


class _Plan:
    """What the graphs key a forward on (the plan in a model)."""


def _stack(kind=_Block, dtype=torch.bfloat16):
    return [kind(seed).cuda().to(dtype) for seed in range(BLOCKS)]


def _through(blocks, x, graphs=None):
    """The blocks in turn, each replayed from `graphs` where it serves (eagerly where it hands back None)."""
    plan, outs = _Plan(), []
    for block in blocks:
        out = None
        if graphs is not None and graphs.enabled:
            live = [getattr(block, name).weight for name in LINEARS]
            names = ["scale", *(f"{name}.weight" for name in LINEARS)]

            def body(x, scale, *weights, block=block, names=names):
                return torch.func.functional_call(block, dict(zip(names, (scale, *weights))), (x,))

            out = graphs.run("block", plan, (), body, [x, block.scale], live)
        x = block(x) if out is None else out
        outs.append(x)
    return outs


@pytest.mark.parametrize("autocast,dtype", [(False, torch.bfloat16), (True, torch.float32), (True, torch.float64)])
def test_replayed_blocks_give_their_eager_outputs_bit_for_bit_on_their_own_weights(autocast, dtype):
    """Under autocast float32 blocks run their linears in bfloat16; float64 ones in float64 (autocast casts no double)."""
    blocks = _stack(dtype=dtype)
    x = torch.randn(1, ROWS, WIDTH, device="cuda", dtype=dtype)
    graphs = CallGraphs(enabled=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        eager = _through(blocks, x)
        replayed = _through(blocks, x, graphs)
    assert (graphs.captures, graphs.replays) == (1, BLOCKS - 1)  # the first eager, the second captured
    for a, b in zip(replayed, eager):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the statics hold the input and the scale: no linear's weight was copied
    (entry,) = graphs.entries.values()
    assert sum(s.numel() for s in entry.statics) == ROWS * WIDTH + WIDTH
    # the graph between q and k captured nothing: held, not replayed (torch's warning says so at the capture's end)
    assert len(entry.graph.idle) == 1
    graphs.release()


def test_a_block_reading_a_linears_weight_outside_f_linear_is_not_captured():
    blocks = _stack(_ReadsItsWeight)
    x = torch.randn(1, ROWS, WIDTH, device="cuda", dtype=torch.bfloat16)
    graphs = CallGraphs(enabled=True)
    with torch.no_grad():
        eager = _through(blocks, x)
        with pytest.warns(CallGraphUnavailable, match="outside F.linear"):
            outs = _through(blocks, x, graphs)
    assert graphs.replays == 0 and not graphs.enabled
    assert all(torch.equal(a, b) for a, b in zip(outs, eager))


class _Racing(_Block):
    """Lets another thread run one of its linears as it is while the block is captured (`functional_call` has swapped
    the block's weights for the capture's placeholders)."""

    meanwhile = None

    def forward(self, x):
        if self.meanwhile is not None:
            self.meanwhile()
        return super().forward(x)


def test_another_thread_running_a_linear_of_a_block_under_capture_computes_on_its_real_weight():
    blocks = _stack(_Racing)
    x = torch.randn(1, ROWS, WIDTH, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(3, WIDTH, device="cuda", dtype=torch.bfloat16)
    graphs = CallGraphs(enabled=True)
    with torch.no_grad():
        eager = _through(blocks, x)
        expected_other = F.linear(other, blocks[1].q.weight)
        # on the default stream, which the comparison below is on too
        seen = once_in_another_thread(blocks[1], lambda: blocks[1].q(other))
        replayed = _through(blocks, x, graphs)
    assert graphs.captures == 1 and graphs.replays == BLOCKS - 1
    assert "error" not in seen and torch.equal(seen["out"], expected_other)
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))
    graphs.release()
