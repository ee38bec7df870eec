"""`shared_prefix_cuda_graphs` on the GPU: the model's own training step with its decoder-layer stack
replayed as CUDA graphs gives the eager step's loss (bit for bit: the forward kernels are
deterministic) and gradients (within the eager-vs-eager floor: index_add_ and fla's atomics are not),
for a batch that captures, one that replays the captured graph, and one that needs a new capture;
over two accumulated micro-batches; after other layouts' eager steps have flushed fla's chunk-table
cache (the graph must not read memory that cache freed); with no AccumulateGrad stream warning. Those
tests key the graphs on the exact layout (buckets off). With buckets (the default), two layouts of one
bucket replay one capture: the graphed step equals the eager step on the same padded plan (loss bit for
bit, gradients within the floor), and the unpadded eager step up to bf16 rounding.

Generated GPU module, 8 layers (6 GDN + 2 attention at Qwen3.5-4B head widths, so fla's tuned
configurations apply; hidden 1024), bf16, real backends. Skipped without CUDA.
"""

import contextlib
import warnings

import pytest
import torch

from tests.models import tiny

pytestmark = pytest.mark.gpu

MODULE = "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu"
WIDTHS = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=8192,
)
LAYERS = 8
A = (1000, [200, 130, 257, 64])  # prompt, responses: one GRPO group of 4
A_AGAIN = A  # same layout, other tokens: replays A's graph
C = (1000, [180, 130, 257, 64])  # one response shorter: a new capture
D = (700, [90, 300])  # other layouts, run eagerly in between
E = (1200, [50, 60, 70])


def _model(graphs: bool, cache: int = 2, dtype: torch.dtype = torch.bfloat16, buckets: bool = False):
    import importlib

    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        num_hidden_layers=LAYERS,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,
        use_cache=False,
        **WIDTHS,
    )
    config.shared_prefix_training = True
    config.shared_prefix_cuda_graphs = graphs
    # the replays under test: every call replays (the default "auto" runs some eagerly by measured time)
    config.shared_prefix_cuda_graphs_training = config.shared_prefix_cuda_graphs_scoring = "graphs"
    config.shared_prefix_cuda_graphs_cache = cache
    config.shared_prefix_cuda_graphs_buckets = buckets
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = importlib.import_module(MODULE).Qwen3_5ForCausalLM(config).to(dtype)
    return model.train()


def _batch(shape, seed):
    prompt, responses = shape
    ids, cu, prompt_mask = tiny.grpo_batch([(prompt, responses)], seed=seed, vocab=WIDTHS["vocab_size"])
    labels = ids.masked_fill(prompt_mask, -100)
    return ids.cuda(), labels.cuda(), {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in tiny.packed_kwargs(cu).items()}


def _step(model, batch, scale=1.0):
    ids, labels, kwargs = batch
    out = model(input_ids=ids, labels=labels, return_logits=False, **kwargs)
    (out.loss * scale).backward()
    return out.loss.detach()


def _run(model, batches):
    """Per entry of `batches` (a list of micro-batches accumulated into one step): the losses and the gradients."""
    model.zero_grad(set_to_none=True)
    losses = [_step(model, b, scale=1.0 + i) for i, b in enumerate(batches)]
    return losses, {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _largest(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@contextlib.contextmanager
def _padded(on: bool, graphed_model=None):
    """Eager steps on plans padded as a graphed step's are (the graphs pad only when they are on), to the
    buckets `graphed_model`'s graphs hold now (a plan pads to a held bucket it fits)."""
    from patchgen.kernels.modeling import shared_prefix
    from patchgen.kernels.modeling.layer_graphs import graphs_of

    if not on:
        yield
        return
    graphs = None if graphed_model is None else graphs_of(graphed_model)
    held = () if graphs is None else graphs.held_buckets()
    originals = shared_prefix.pads_to_bucket, shared_prefix.held_buckets
    shared_prefix.pads_to_bucket = lambda config: torch.is_grad_enabled()
    shared_prefix.held_buckets = lambda config: held
    try:
        yield
    finally:
        shared_prefix.pads_to_bucket, shared_prefix.held_buckets = originals


@pytest.fixture(scope="module")
def models():
    eager, graphed = _model(graphs=False), _model(graphs=True)
    graphed.load_state_dict(eager.state_dict())  # the same weights, whatever the initialisation did
    return eager, graphed


def _check(models, batches, what, padded_eager=False):
    eager_model, graphed_model = models
    with _padded(padded_eager, graphed_model):
        eager = _run(eager_model, batches)
        again = _run(eager_model, batches)
    floor = _largest(eager[1], again[1])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graphed = _run(graphed_model, batches)
    stream_warnings = [str(w.message)[:120] for w in seen if "AccumulateGrad" in str(w.message)]
    diff = _largest(eager[1], graphed[1])
    print(f"{what}: loss eager {[l.item() for l in eager[0]]} graphed {[l.item() for l in graphed[0]]}; "
          f"max |d grad| graphed-vs-eager {diff:.3g}, eager-vs-eager floor {floor:.3g}")
    assert not stream_warnings, stream_warnings
    for e, g in zip(eager[0], graphed[0]):
        assert torch.equal(e, g), (what, e.item(), g.item())
    assert diff <= 2 * floor if floor > 0 else diff == 0.0, (what, diff, floor)


def test_graphed_step_equals_the_eager_step_capture_replay_and_new_capture(models):
    from patchgen.kernels.modeling.layer_graphs import graphs_of

    graphed_model = models[1]
    _check(models, [_batch(A, seed=1)], "A (captures)")
    stats = graphs_of(graphed_model).stats
    assert (stats.captures, stats.replays) == (1, 0)
    # two accumulated micro-batches of A's layout with other tokens: both replay A's graph
    _check(models, [_batch(A_AGAIN, seed=2), _batch(A_AGAIN, seed=3)], "A layout x2 accumulated (replays)")
    assert (stats.captures, stats.replays) == (1, 2)
    _check(models, [_batch(C, seed=4)], "C (new capture)")
    assert (stats.captures, stats.replays) == (2, 2)
    # other layouts' eager steps churn fla's chunk-table cache; A's graph still reads valid memory
    for shape, seed in ((D, 5), (E, 6), (D, 7)):
        _run(models[0], [_batch(shape, seed=seed)])
    _check(models, [_batch(A, seed=8)], "A after other layouts (replays)")
    assert (stats.captures, stats.replays, stats.evictions) == (2, 3, 0)


def test_a_third_layout_evicts_the_least_recently_used_graph(models):
    from patchgen.kernels.modeling.layer_graphs import graphs_of

    graphed_model = models[1]
    # the cache (two graphs) holds A and C whichever tests ran before in this process (alone, it captures them)
    _check(models, [_batch(A, seed=20)], "A (fills the cache)")
    _check(models, [_batch(C, seed=21)], "C (fills the cache)")
    stats = graphs_of(graphed_model).stats
    before = (stats.captures, stats.evictions)
    _check(models, [_batch(D, seed=9)], "D (capture, evicts)")
    assert (stats.captures, stats.evictions) == (before[0] + 1, before[1] + 1)
    assert len(graphs_of(graphed_model).cache) == 2
    # the one evicted was A, the least recently used: C still replays, A captures again
    _check(models, [_batch(C, seed=22)], "C (still held: replays)")
    assert stats.captures == before[0] + 1
    _check(models, [_batch(A, seed=23)], "A (evicted: captures again)")
    assert stats.captures == before[0] + 2


def test_a_backward_after_a_later_replay_of_the_same_graph_raises(models):
    from patchgen.kernels.errors import GraphReplayOverwritten

    graphed_model = models[1]
    graphed_model.zero_grad(set_to_none=True)
    ids, labels, kwargs = _batch(A, seed=10)
    first = graphed_model(input_ids=ids, labels=labels, return_logits=False, **kwargs).loss
    second = graphed_model(input_ids=ids, labels=labels, return_logits=False, **kwargs).loss
    with pytest.raises(GraphReplayOverwritten):
        first.backward()
    second.backward()
    graphed_model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_replays_read_the_weights_of_the_latest_update(dtype, autocast):
    """An in-place update between steps (what an optimizer step does) is read by the next replay; float32
    weights under bf16 autocast (HF Trainer's bf16=True) too, where a capture on autocast's cast cache
    would replay the capture step's weights forever."""
    from patchgen.kernels.modeling.layer_graphs import graphs_of

    eager, graphed = _model(graphs=False, dtype=dtype), _model(graphs=True, dtype=dtype)
    graphed.load_state_dict(eager.state_dict())
    batch = _batch(A, seed=12)
    noise = {n: torch.randn_like(p) * 1e-2 for n, p in eager.named_parameters() if ".layers." in n}
    losses = []
    for _ in range(3):
        step = []
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                step.append(_step(model, batch))
            with torch.no_grad():  # the same in-place update on both models (an optimizer step, deterministic)
                for n, p in model.named_parameters():
                    if n in noise:
                        p.add_(noise[n])
        assert torch.equal(*step), [x.item() for x in step]
        losses.append(step[1].item())
    assert len(set(losses)) == 3, losses  # the updates changed the loss: the replays read them
    assert (graphs_of(graphed).stats.captures, graphs_of(graphed).stats.replays) == (1, 2)


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_scoring_forwards_replay_their_own_graph_and_equal_the_eager_logits(dtype, autocast):
    """An RL step's log-prob passes (no gradient, a plan): the scoring graph's logits are the eager forward's
    bit for bit, at capture, at a replay with other tokens, after an in-place weight update, and beside a
    training step of the same layout (which keeps its own graph)."""
    from patchgen.kernels.modeling.layer_graphs import graphs_of

    eager, graphed = _model(graphs=False, dtype=dtype), _model(graphs=True, dtype=dtype)
    graphed.load_state_dict(eager.state_dict())

    def score(model, seed):
        ids, _, kwargs = _batch(A, seed=seed)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=ids, **kwargs).logits

    for seed in (20, 21):
        assert torch.equal(score(eager, seed), score(graphed, seed)), seed
    with torch.no_grad():
        for model in (eager, graphed):
            for n, p in model.named_parameters():
                if ".layers." in n:
                    p.add_(torch.full_like(p, 1e-2))
    assert torch.equal(score(eager, 22), score(graphed, 22))
    for model in (eager, graphed):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            _step(model, _batch(A, seed=23))
    assert torch.equal(score(eager, 24), score(graphed, 24))
    stats = graphs_of(graphed).stats
    assert (stats.captures, stats.replays) == (2, 3)  # one scoring graph, one training graph


# GRPO groups of one bucket (prompt and response lengths all differ), and one of another bucket
BUCKET = [(1000, [200, 130, 257, 64]), (1028, [205, 140, 268, 90])]  # one bucket (test_bucket.py checks it on the host)
OTHER_BUCKET = (1500, [400, 300, 257, 64])


@pytest.fixture(scope="module")
def bucket_models():
    eager, graphed = _model(graphs=False), _model(graphs=True, buckets=True)
    graphed.load_state_dict(eager.state_dict())
    return eager, graphed


def test_layouts_of_one_bucket_replay_one_capture(bucket_models):
    from patchgen.kernels.modeling.layer_graphs import graphs_of
    from patchgen.kernels.shared_prefix import build_plan

    buckets = []
    for shape in (*BUCKET, OTHER_BUCKET):
        ids, _, kwargs = _batch(shape, seed=0)
        buckets.append(build_plan(ids, kwargs["cu_seq_lens_q"], conv_kernel_size=4, pad_to_bucket=True).bucket)
    assert buckets[0] == buckets[1] != buckets[2]
    _check(bucket_models, [_batch(BUCKET[0], seed=1)], "bucket, first layout (captures)", padded_eager=True)
    stats = graphs_of(bucket_models[1]).stats
    assert (stats.captures, stats.replays) == (1, 0)
    _check(bucket_models, [_batch(BUCKET[1], seed=2)], "bucket, second layout (replays)", padded_eager=True)
    _check(bucket_models, [_batch(BUCKET[1], seed=3), _batch(BUCKET[0], seed=4)],
           "bucket, both layouts accumulated (replay)", padded_eager=True)
    assert (stats.captures, stats.replays) == (1, 3)
    _check(bucket_models, [_batch(OTHER_BUCKET, seed=5)], "other bucket (captures)", padded_eager=True)
    _check(bucket_models, [_batch(BUCKET[0], seed=6)], "bucket, first layout again (replays)", padded_eager=True)
    assert (stats.captures, stats.replays, stats.evictions) == (2, 4, 0)


def test_a_padded_step_equals_the_unpadded_step_up_to_bf16_rounding(bucket_models):
    """The padding changes no real row (exact in float64 on the CPU: tests/models/test_layer_graph_buckets.py);
    in bf16 a GEMM over more rows may take another kernel, so here only a gross-error guard, printed."""
    eager_model = bucket_models[0]
    batch = [_batch(BUCKET[1], seed=7)]
    plain = _run(eager_model, batch)
    again = _run(eager_model, batch)
    with _padded(True):
        padded = _run(eager_model, batch)
    floor, diff = _largest(plain[1], again[1]), _largest(plain[1], padded[1])
    scale = max(g.abs().max().item() for g in plain[1].values())
    print(f"padded vs unpadded eager: loss {plain[0][0].item()} / {padded[0][0].item()}; max |d grad| {diff:.3g} "
          f"(floor {floor:.3g}, largest gradient {scale:.3g})")
    assert abs(plain[0][0].item() - padded[0][0].item()) <= 1e-2 * abs(plain[0][0].item())
    assert diff <= 0.05 * scale


# "auto" (the default): per call a replay on the padded bucket or an eager call on the unpadded plan, by CUDA-event
# times; the sequence gives it a capture, replays to measure, eager calls to measure, then its own choices
AUTO_STEPS = [A, A, A, A, D, E, A, C, D, A, E, C]


@pytest.fixture(scope="module")
def auto_models():
    eager, auto = _model(graphs=False), _model(graphs=True, buckets=True)
    auto.config.shared_prefix_cuda_graphs_training = auto.config.shared_prefix_cuda_graphs_scoring = "auto"
    auto.load_state_dict(eager.state_dict())
    return eager, auto


def test_auto_takes_both_ways_and_each_step_gives_the_eager_models_loss_and_gradients(auto_models):
    """An eager call runs the no-graphs model's kernels on the same unpadded plan: its loss bit for bit, gradients
    within the eager-vs-eager floor; a replay ran the padded plan (a gross-error guard, as for padded steps)."""
    from patchgen.kernels.modeling.layer_graphs import graphs_of

    eager_model, auto_model = auto_models
    ways = []
    for i, shape in enumerate(AUTO_STEPS):
        batch = [_batch(shape, seed=40 + i)]
        plain, again = _run(eager_model, batch), _run(eager_model, batch)
        stats = graphs_of(auto_model).stats if graphs_of(auto_model) is not None else None
        eager_before = 0 if stats is None else stats.eager
        auto = _run(auto_model, batch)
        went_eager = graphs_of(auto_model).stats.eager > eager_before
        ways.append("eager" if went_eager else "graph")
        floor, diff = _largest(plain[1], again[1]), _largest(plain[1], auto[1])
        scale = max(g.abs().max().item() for g in plain[1].values())
        print(f"auto step {i} ({ways[-1]}): loss {plain[0][0].item()} / {auto[0][0].item()}; max |d grad| {diff:.3g} "
              f"(floor {floor:.3g})")
        if went_eager:
            assert torch.equal(plain[0][0], auto[0][0]), (i, plain[0][0].item(), auto[0][0].item())
            assert diff <= 2 * floor if floor > 0 else diff == 0.0, (i, diff, floor)
        else:
            assert abs(plain[0][0].item() - auto[0][0].item()) <= 1e-2 * abs(plain[0][0].item())
            assert diff <= 0.05 * scale
    choice = graphs_of(auto_model).choice
    print(ways, choice.describe())
    assert ways[0] == "graph" and "eager" in ways  # the first step captures; eager calls are measured too
    # both ways were timed on the device (CUDA events, read without a sync) and fitted
    assert choice.call_time("train", "replay").ms(1000) > 0 and choice.call_time("train", "eager").ms(1000) > 0


def test_auto_scoring_forwards_give_the_eager_models_logits(auto_models):
    from patchgen.kernels.modeling.layer_graphs import graphs_of

    eager_model, auto_model = auto_models
    ways = []
    with torch.no_grad():
        for i, shape in enumerate(AUTO_STEPS):
            ids, _, kwargs = _batch(shape, seed=60 + i)
            plain = eager_model(input_ids=ids, **kwargs).logits
            before = graphs_of(auto_model).stats.eager if graphs_of(auto_model) is not None else 0
            auto = auto_model(input_ids=ids, **kwargs).logits
            went_eager = graphs_of(auto_model).stats.eager > before
            ways.append("eager" if went_eager else "graph")
            if went_eager:
                assert torch.equal(plain, auto), i
            else:
                assert (plain.float() - auto.float()).abs().max().item() <= 0.05 * plain.float().abs().max().item()
    print(ways, graphs_of(auto_model).choice.describe())
    assert "eager" in ways and "graph" in ways
    assert graphs_of(auto_model).choice.call_time("score", "eager") is not None
