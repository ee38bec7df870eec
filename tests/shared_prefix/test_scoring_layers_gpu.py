"""A shared-prefix scoring forward's decoder layers replayed from one CUDA graph per kind (`modeling/scoring_layers.py`)
on the GPU: the generated model's log-probs are the eager forward's bit for bit under no_grad and inference mode,
per kind the first layer runs eagerly (in a later forward it captures), the second captures where enough follow and the
rest replay, and the reserved memory stays flat over forwards on new plans. 8 layers at Qwen3.5-4B head widths (test_layer_graphs_gpu.py's model), bf16, real
backends, the layer-stack graphs off. Skipped without CUDA."""

import pytest
import torch
from patchgen.kernels.shared_prefix.call_graphs import LAYER_GRAPHS

from tests.shared_prefix.test_call_graphs_gpu import fresh
from tests.shared_prefix.test_layer_graphs_gpu import A_AGAIN, A, C, D, E, _batch, _model

pytestmark = pytest.mark.gpu


@pytest.fixture
def layer_graphs():
    yield from fresh(LAYER_GRAPHS)


def _log_probs(model, batch, enabled: bool):
    ids, _, kwargs = batch
    LAYER_GRAPHS.enabled = enabled
    return model(input_ids=ids, return_log_probs=True, return_logits=False, **kwargs).log_probs


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_scoring_forward_through_the_layer_graphs_gives_the_eager_log_probs_bit_for_bit(mode, layer_graphs):
    model = _model(graphs=False).eval()
    with mode():
        for n, shape in enumerate((A, A_AGAIN, C), start=1):
            batch = _batch(shape, seed=n)
            eager = _log_probs(model, batch, False)
            replayed = _log_probs(model, batch, True)
            assert torch.equal(replayed, eager)
            # the first forward: 6 GDN layers eager, captured, 4 replayed; 2 attention layers eager, captured (a
            # capture also replays). The next (another plan of A's shapes, whose kernels are all loaded): the first
            # GDN layer captured, 5 replayed; both attention layers eager (a capture for one replay does not pay:
            # `CallGraphs._pays`). On C's shapes the first GDN layer's capture may meet a kernel of a new
            # specialisation: then it runs eagerly, and the second captures (`capture_guard.py`)
            expected = ((2, 6, 0), (3, 12, 0), (4, 18 - layer_graphs.not_warm, layer_graphs.not_warm))[n - 1]
            assert (layer_graphs.captures, layer_graphs.replays, layer_graphs.not_warm) == expected


def test_layer_graphs_of_new_plans_reuse_the_memory_of_those_they_replace(layer_graphs):
    model = _model(graphs=False).eval()
    # every layout twice over: a graph that kept its memory when replaced would reserve more on each new plan
    batches = [_batch(shape, seed=i) for i, shape in enumerate((A, C, D, E) * 2)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = []
    with torch.no_grad():
        for batch in batches:
            _log_probs(model, batch, True)
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    assert layer_graphs.captures == len(batches) + 1  # the attention layers' only in the first forward
    # one pool for every graph of the device; a pool per graph would stay reserved when its graph goes, a layer graph's
    # working memory more per plan. What the allocator still rounds up (22 MB once over six forwards on the H200) is
    # bounded: seven forwards on new plans after the first reserve less than 64 MB in all
    assert len(layer_graphs._capture_on) == 1
    assert reserved[-1] - reserved[1] < 64 * 2**20, [r / 2**20 for r in reserved]


def test_a_training_forward_never_replays_a_layer(layer_graphs):
    model = _model(graphs=False)
    ids, labels, kwargs = _batch(A, seed=0)
    LAYER_GRAPHS.enabled = True
    model(input_ids=ids, labels=labels, return_logits=False, **kwargs).loss.backward()
    assert (layer_graphs.captures, layer_graphs.replays) == (0, 0)


EXIT_SCRIPT = """
import sys, torch
sys.path.append({root!r})  # after the staged package: the tests' helpers only
from patchgen.kernels.shared_prefix.call_graphs import LAYER_GRAPHS
from tests.shared_prefix.test_layer_graphs_gpu import A, C, _batch, _model
LAYER_GRAPHS.enabled = True
model = _model(graphs=False).eval()
with torch.no_grad():
    for seed, shape in enumerate((A, C, A)):  # captured, replaced, replaced
        ids, _, kwargs = _batch(shape, seed)
        model(input_ids=ids, return_log_probs=True, return_logits=False, **kwargs)
assert LAYER_GRAPHS.captures >= 4 and LAYER_GRAPHS.replays > 0, LAYER_GRAPHS.replays
print("scored")
"""


def test_a_process_that_replayed_layer_graphs_exits_cleanly():
    """A layer graph's linears call cuBLAS, whose workspace for the capture stream would live in the graphs' pool:
    left there, the process aborted at exit ("double free or corruption") once the pool was gone."""
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT.format(root=root)], check=False, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0 and "scored" in done.stdout, done.stderr[-2000:]
