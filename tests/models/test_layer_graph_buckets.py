"""`shared_prefix_cuda_graphs` with buckets (the default): the plan of a graphed step is padded to bucket
counts, so one capture serves every layout of its bucket. CPU, float64, `EagerReplay` (the static buffers,
loads, keys and autograd node of the graphs, run eagerly): a padded graphed step equals the unpadded
eager step to 1e-10 (loss, logits at every position, every parameter gradient) for layouts of one bucket,
which replay the first capture; a layout of another bucket captures anew."""

import pytest
import torch
from patchgen.kernels.graphs import EagerReplay
from patchgen.kernels.modeling import layer_graphs, shared_prefix
from patchgen.kernels.shared_prefix import build_plan

from tests.models import tiny

OTHER_BUCKET = [(150, [40, 3, 9, 21])]
# the replays' machinery under test: every call replays (the default "auto" would run some eagerly by measured time)
ALWAYS_REPLAY = dict(shared_prefix_cuda_graphs_training="graphs", shared_prefix_cuda_graphs_scoring="graphs")


def _batch(groups, seed):
    ids, cu, prompt = tiny.grpo_batch(groups, seed=seed)
    return ids, ids.masked_fill(prompt, -100), tiny.packed_kwargs(cu)


def _bucket(groups):
    ids, cu, _ = tiny.grpo_batch(groups)
    return build_plan(ids, cu, conv_kernel_size=4, pad_to_bucket=True).bucket


def _random_mates(base, count, seed=0):
    """`base` and `count` random GRPO layouts of its bucket, each with another prompt length and other
    response lengths than every layout before it (drawn near base's)."""
    gen = torch.Generator().manual_seed(seed)
    want, out = _bucket(base), [base]
    for _ in range(1000):
        (p, responses), = base
        draw = [(p + int(torch.randint(-6, 7, (1,), generator=gen)),
                 [max(1, r + int(torch.randint(-4, 5, (1,), generator=gen))) for r in responses])]
        if all(draw[0][0] != o[0][0] and draw[0][1] != o[0][1] for o in out) and _bucket(draw) == want:
            out.append(draw)
            if len(out) > count:
                return out
    raise AssertionError(f"fewer than {count} layouts share {base}'s bucket")


ONE_BUCKET = _random_mates([(70, [5, 9, 3])], 2)


def test_the_layouts_share_one_bucket_and_the_other_does_not():
    buckets = {_bucket(g) for g in ONE_BUCKET}
    assert len(buckets) == 1 and _bucket(OTHER_BUCKET) not in buckets


def _model(model, graphs):
    net = tiny.build(model, "gpu", shared_prefix_training=True, shared_prefix_cuda_graphs=graphs, **ALWAYS_REPLAY)
    if graphs:
        layer_graphs.use_graphs(net.model, layer_graphs.LayerGraphs(2, replay=EagerReplay))
    return net


def _extra(net):
    # an MoE model's router logits are refused under the graphs (docs/cuda_graphs.md): train without them
    return {"output_router_logits": False} if "moe" in type(net).__module__ else {}


def _loss_step(net, batch):
    net.zero_grad(set_to_none=True)
    ids, labels, packed = batch
    loss = net(input_ids=ids, labels=labels, **packed, **_extra(net)).loss
    loss.backward()
    return loss.detach(), tiny.grads(net)


def _logits_step(net, batch, weights):
    """Logits at every packed position (no labels), and the gradients of a weighted sum of them."""
    net.zero_grad(set_to_none=True)
    ids, _, packed = batch
    logits = net(input_ids=ids, **packed, **_extra(net)).logits
    (logits * weights[: logits.shape[1]]).sum().backward()
    return logits.detach(), tiny.grads(net)


def _close(eager, graphed):
    torch.testing.assert_close(graphed[0], eager[0], atol=1e-10, rtol=0)
    tiny.assert_grads_close(eager[1], graphed[1])


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
def test_layouts_of_one_bucket_replay_one_capture_and_equal_the_unpadded_step(model):
    eager, graphed = _model(model, False), _model(model, True)
    stats = layer_graphs.graphs_of(graphed).stats
    weights = torch.randn(256, tiny.VOCAB, dtype=torch.float64)
    layouts = ONE_BUCKET if model == "qwen3_5" else ONE_BUCKET[:2]  # MoE: two layouts (its step is the slowest)
    for i, groups in enumerate(layouts):
        batch = _batch(groups, seed=i)
        _close(_loss_step(eager, batch), _loss_step(graphed, batch))
        _close(_logits_step(eager, batch, weights), _logits_step(graphed, batch, weights))
    assert len({str(g) for g in layouts}) == len(layouts)  # different lengths, one bucket
    assert (stats.captures, stats.replays) == (1, 2 * len(layouts) - 1)
    batch = _batch(OTHER_BUCKET, seed=9)
    _close(_loss_step(eager, batch), _loss_step(graphed, batch))
    assert (stats.captures, stats.evictions) == (2, 0)


def test_accumulated_micro_batches_of_one_bucket_add_up():
    eager, graphed = _model("qwen3_5", False), _model("qwen3_5", True)
    results = []
    for net in (eager, graphed):
        net.zero_grad(set_to_none=True)
        for i, groups in enumerate(ONE_BUCKET[:2]):
            ids, labels, packed = _batch(groups, seed=i)
            (net(input_ids=ids, labels=labels, **packed).loss * (1 + i)).backward()
        results.append(tiny.grads(net))
    tiny.assert_grads_close(*results)
    assert layer_graphs.graphs_of(graphed).stats.replays == 1


def test_padding_rows_get_no_gradient():
    graphed = _model("qwen3_5", True)
    found = {}

    def keep_gradient(module, args, out):
        out.register_hook(lambda grad: found.setdefault("grad", grad))

    graphed.model.embed_tokens.register_forward_hook(keep_gradient)
    groups = ONE_BUCKET[0]
    ids, labels, packed = _batch(groups, seed=0)
    graphed(input_ids=ids, labels=labels, **packed).loss.backward()
    grad = found["grad"]  # the compact row's embeddings, padding rows at the end
    real = build_plan(ids, packed["cu_seq_lens_q"], conv_kernel_size=4).compact_length
    assert grad.shape[1] == _bucket(groups)[0] > real
    assert torch.count_nonzero(grad[:, real:]) == 0
    assert torch.count_nonzero(grad[:, :real]) > 0


def test_buckets_off_key_the_exact_layout():
    graphed = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_cuda_graphs=True, **ALWAYS_REPLAY,
                         shared_prefix_cuda_graphs_buckets=False)
    layer_graphs.use_graphs(graphed.model, layer_graphs.LayerGraphs(4, replay=EagerReplay))
    for i, groups in enumerate(ONE_BUCKET):
        _loss_step(graphed, _batch(groups, seed=i))
    assert layer_graphs.graphs_of(graphed).stats.captures == len(ONE_BUCKET)


def test_scoring_forwards_of_one_bucket_replay_one_scoring_graph():
    """Log-prob passes (a plan, no gradient) are padded too and replay a forward-only graph per bucket."""
    eager, graphed = _model("qwen3_5", False), _model("qwen3_5", True)
    for i, groups in enumerate(ONE_BUCKET[:2]):
        ids, _, packed = _batch(groups, seed=i)
        with torch.no_grad():
            expected, found = (net(input_ids=ids, **packed).logits for net in (eager, graphed))
        assert found.shape == expected.shape == (1, ids.shape[1], tiny.VOCAB)
        torch.testing.assert_close(found, expected, atol=1e-10, rtol=0)
    stats = layer_graphs.graphs_of(graphed).stats
    assert (stats.captures, stats.replays) == (1, 1)


def test_a_smaller_layout_replays_the_held_graph_of_a_larger_one():
    larger, smaller = [(90, [12, 9, 6])], [(70, [5, 9, 3])]
    assert _bucket(larger) != _bucket(smaller)  # its own bucket is another: it pads up to the held one
    eager, graphed = _model("qwen3_5", False), _model("qwen3_5", True)
    for i, groups in enumerate((larger, smaller)):
        batch = _batch(groups, seed=i)
        _close(_loss_step(eager, batch), _loss_step(graphed, batch))
    stats = layer_graphs.graphs_of(graphed).stats
    assert (stats.captures, stats.replays) == (1, 1)


def _tree_batch(system_length, groups, seed):
    """A system prompt shared by every group, then each group's prompt and responses: a two-level tree."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, tiny.VOCAB, (system_length,), generator=g)
    seqs, labels = [], []
    for p, responses in groups:
        prompt = torch.randint(0, tiny.VOCAB, (p,), generator=g)
        for r in responses:
            seqs.append(torch.cat([system, prompt, torch.randint(0, tiny.VOCAB, (r,), generator=g)]))
            labels.append(seqs[-1].masked_fill(torch.arange(len(seqs[-1])) < system_length + p, -100))
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return torch.cat(seqs)[None], torch.cat(labels)[None], tiny.packed_kwargs(cu)


TREES = [(85, [(72, [7, 33]), (64, [6, 9, 4])]), (80, [(70, [9, 30]), (65, [4, 11, 2])]),
         (82, [(68, [12, 25]), (66, [3, 14, 5])])]  # the largest first: the others fit its bucket


def test_tree_plans_bucket_too():
    tree = {"shared_prefix_max_depth": 2, "shared_prefix_level_cost": 0}
    eager = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, **tree)
    graphed = tiny.build("qwen3_5", "gpu", shared_prefix_training=True, shared_prefix_cuda_graphs=True, **tree,
                         **ALWAYS_REPLAY)
    layer_graphs.use_graphs(graphed.model, layer_graphs.LayerGraphs(2, replay=EagerReplay))
    depths = []
    with shared_prefix.observe_plans(lambda plan, tokens: depths.append(plan.depth)):
        for i, layout in enumerate(TREES):
            batch = _tree_batch(*layout, seed=i)
            _close(_loss_step(eager, batch), _loss_step(graphed, batch))
    assert set(depths) == {2}  # two levels of sharing: three GDN rounds
    stats = layer_graphs.graphs_of(graphed).stats
    assert (stats.captures, stats.replays) == (1, len(TREES) - 1)  # the third pads to the held bucket
