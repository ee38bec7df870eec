"""Issue 19, item 4: the work of a training step grows with the depth of the prefix tree, never with its nodes.

Counted with the flag on, forward and backward, at tiny widths on the CPU: every aten op the model
dispatches outside its op-slot backends (the shared-prefix gathers, GDN rounds, LM rows, loss,
and everything else), and every backend call. A backend counts as one call: inside, the CPU
references loop over sequences, which a GPU kernel does in one launch.
"""

import functools
from collections import Counter

import torch
from patchgen.kernels import ops
from patchgen.kernels.registry import SLOTS
from patchgen.kernels.shared_prefix import build_plan
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from tests.models import tiny
from tests.models.prefix_trees import pack

TREE_CONFIG = {"shared_prefix_max_depth": 4, "shared_prefix_level_cost": 0}


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _opaque(fn, name, calls):
    """`fn` as one autograd node whose forward and backward dispatch nothing the mode sees."""

    def call(*args, **kwargs):
        calls[f"backend {name}"] += 1
        flat = [*args, *kwargs.values()]
        at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]

        class Node(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                with _disable_current_modes(), torch.enable_grad():
                    inner = [x.detach().requires_grad_() for x in inputs]
                    given = list(flat)
                    for i, x in zip(at, inner):
                        given[i] = x
                    out = fn(*given[: len(args)], **dict(zip(kwargs, given[len(args) :])))
                    outs = out if isinstance(out, tuple) else (out,)
                    ctx.inner, ctx.outs = inner, outs
                    return tuple(None if o is None else o.detach() for o in outs)

            @staticmethod
            def backward(ctx, *grads):
                pairs = [(o, g) for o, g in zip(ctx.outs, grads) if o is not None and o.requires_grad and g is not None]
                with _disable_current_modes():
                    return torch.autograd.grad(
                        [o for o, _ in pairs], ctx.inner, [g for _, g in pairs], allow_unused=True
                    )

        result = Node.apply(*(flat[i] for i in at))
        return result if len(result) > 1 else result[0]

    return call


class _Opaque:
    """An op table whose slots run as opaque, counted nodes."""

    def __init__(self, table, calls):
        self._table, self._calls = table, calls

    def __getattr__(self, name):
        value = getattr(self._table, name)
        return _opaque(value, name, self._calls) if name in SLOTS else value


@functools.cache
def _step_ops(fan, turns):
    """Aten ops and backend calls of one training step (flag on), with the plan's depth and node count."""
    gen = torch.Generator().manual_seed(11)

    def toks(n):
        return torch.randint(0, tiny.VOCAB, (n,), generator=gen).tolist()

    seqs = [toks(64)]
    for length in (*turns, 1):  # branch `fan` ways after the prompt and after every shared turn
        seqs = [s + toks(length) for s in seqs for _ in range(fan)]
    ids, cu = pack(seqs)
    plan = build_plan(ids, cu, max_depth=4, level_cost=0)
    net = tiny.build("qwen3_5", "gpu", seed=3, shared_prefix_training=True, **TREE_CONFIG)
    counting = _Counting()
    real_of = ops.of
    ops.of = lambda module: _Opaque(real_of(module), counting.calls)
    try:
        with counting:
            net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu)).loss.backward()
    finally:
        ops.of = real_of
    return counting.calls, plan.depth, len(plan.nodes)


def test_ops_and_backend_calls_do_not_grow_with_nodes():
    few, depth, nodes = _step_ops(fan=2, turns=(64,))
    many, wide_depth, wide_nodes = _step_ops(fan=4, turns=(64,))
    assert (depth, nodes) == (wide_depth, 3) and wide_nodes == 5
    assert few["backend gated_delta_rule"] == 2 * (depth + 1)  # two linear-attention layers, a round per level + 1
    assert few == many  # op by op, forward and backward


def test_one_more_level_adds_a_gdn_round_per_layer():
    two, _, _ = _step_ops(fan=2, turns=(64,))
    three, depth, _ = _step_ops(fan=2, turns=(64, 64))
    assert depth == 3
    assert three["backend gated_delta_rule"] - two["backend gated_delta_rule"] == 2
    for slot in ("causal_conv1d", "attention", "cross_entropy"):
        assert three[f"backend {slot}"] == two[f"backend {slot}"]


def test_three_levels_of_few_or_many_nodes_take_the_same_ops():
    """Depth 3, branching in two or in three after the prompt and after every turn: the same ops and
    backend calls op by op, forward and backward (4 GDN rounds per linear-attention layer)."""
    few, depth, nodes = _step_ops(fan=2, turns=(64, 64))
    many, wide_depth, wide_nodes = _step_ops(fan=3, turns=(64, 64))
    assert depth == wide_depth == 3 and wide_nodes >= 2 * nodes
    assert few["backend gated_delta_rule"] == 2 * (depth + 1)
    assert few == many
