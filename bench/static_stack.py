"""A training step on one fixed micro-batch with the decoder-layer stack as one callable (for CUDA graphs).

`probe` runs the model's own forward once and records what its text model hands each decoder layer
(the hidden states, the rotary cos/sin, the packed row or the shared-prefix plan) and what its LM
head reads (labels, boundaries). Everything the step decides on the host from the batch (the plan,
the boundary checks and their host copies) is thereby done once, before any capture. `LayerStack`
runs the layers on those recorded arguments, `static_step` does embedding, stack, final norm, LM
head + loss and backward: the same ops as the model's own training step, in the same order, as
long as the batch is the recorded one (the bench replays one micro-batch; a graph needs that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from patchgen.kernels import ops
from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head
from shared_prefix_arms import boundary_labels, packed_kwargs

PLAN = "shared_prefix"  # the keyword the plan travels under (kernels/modeling/shared_prefix.KWARG)
HEAD_KWARGS = ("cu_seq_lens_q", "shift_labels", "num_items_in_batch")  # what causal_lm_head reads of kwargs


class ProbeMismatch(RuntimeError):
    """The model's forward did not call its layers as the static stack assumes (a model this bench does not know)."""


@dataclass
class StaticBatch:
    """What one recorded forward handed the layers and the head; valid for that micro-batch only."""

    input_ids: torch.Tensor  # the packed row [1, T]
    embed_ids: torch.Tensor  # what the embedding read: the compact row [1, C] under a plan, else input_ids
    cos: torch.Tensor
    sin: torch.Tensor
    layer_kwargs: list[dict]  # per layer, minus hidden_states and position_embeddings
    plan: object | None
    labels: torch.Tensor
    head_kwargs: dict


def probe(model, ids, cu, max_len) -> StaticBatch:
    """Run `model` once (no grad) on the packed row and record the layers' and the head's arguments."""
    text = model.model
    seen: dict = {}

    def record(key):
        def hook(module, args, kwargs):
            seen[key] = (args, dict(kwargs))

        return hook

    handles = [text.register_forward_pre_hook(record("text"), with_kwargs=True)]
    handles.append(text.embed_tokens.register_forward_pre_hook(record("embed"), with_kwargs=True))
    handles += [
        layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(text.layers)
    ]
    labels = boundary_labels(ids, cu)
    try:
        with torch.no_grad():
            model(input_ids=ids, labels=labels, return_logits=False, **packed_kwargs(cu, max_len))
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in range(len(text.layers)) if i not in seen]
    if "embed" not in seen or missing:
        raise ProbeMismatch(
            f"the forward did not reach the embedding and every layer (layers not called: {missing}); "
            "the static stack needs a text model that embeds input_ids and calls each layer once"
        )
    layer_kwargs, position = [], None
    for i in range(len(text.layers)):
        args, kwargs = seen[i]
        if len(args) != 1 or "position_embeddings" not in kwargs:
            raise ProbeMismatch(
                f"layer {i} was called with {len(args)} positional arguments and keywords {sorted(kwargs)}; "
                "expected (hidden_states, position_embeddings=..., ...)"
            )
        position = position or kwargs["position_embeddings"]
        if kwargs["position_embeddings"] is not position:
            raise ProbeMismatch(f"layer {i} got other rotary cos/sin than layer 0: one shared pair expected")
        layer_kwargs.append({k: v for k, v in kwargs.items() if k != "position_embeddings"})
    text_kwargs = seen["text"][1]
    embed_ids = seen["embed"][0][0] if seen["embed"][0] else seen["embed"][1]["input"]
    head_kwargs = {k: text_kwargs[k] for k in HEAD_KWARGS if text_kwargs.get(k) is not None}
    if "cu_seq_lens_q" not in head_kwargs:
        head_kwargs["cu_seq_lens_q"] = cu  # the plan path strips the boundaries below the top model
    cos, sin = position
    return StaticBatch(ids, embed_ids, cos, sin, layer_kwargs, text_kwargs.get(PLAN), labels, head_kwargs)


class LayerStack(torch.nn.Module):
    """The decoder layers as one module of tensors only: `(hidden [1, C, d], cos, sin) -> hidden`.

    The layers are the model's own modules (same parameters); the other arguments are the recorded
    ones. `torch.cuda.make_graphed_callables` takes this module (it replaces its `forward`), so a
    fresh one is built for every graph.
    """

    def __init__(self, layers, layer_kwargs: list[dict]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.layer_kwargs = layer_kwargs

    def forward(self, hidden, cos, sin):
        for layer, kwargs in zip(self.layers, self.layer_kwargs):
            hidden = layer(hidden, position_embeddings=(cos, sin), **kwargs)
        return hidden


def stack_of(model, batch: StaticBatch) -> LayerStack:
    return LayerStack(list(model.model.layers), batch.layer_kwargs)


def zero_grads(model) -> None:
    """Gradients as persistent buffers, zeroed in place (allocated on first use).

    A graphed backward writes its parameter gradients into static buffers and autograd then adds
    them to `.grad`; with `.grad` None it would instead keep the static buffer itself as `.grad`,
    which the next replay overwrites (gradient accumulation over micro-batches would then double the
    last one). Kept buffers make every step an in-place add, the same in eager and graphed steps.
    """
    grads = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            grads.append(p.grad)
    if grads:
        torch._foreach_zero_(grads)


def static_step(model, stack, batch: StaticBatch, *, scale: float = 1.0, zero: bool = True) -> torch.Tensor:
    """Embedding, `stack`, final norm, LM head + loss, backward of `scale * loss`; returns the loss (detached).

    `zero=False` accumulates onto the gradients already there (a second micro-batch).
    """
    if zero:
        zero_grads(model)
    text = model.model
    hidden = stack(text.embed_tokens(batch.embed_ids), batch.cos, batch.sin)
    hidden = text.norm(hidden)
    head = causal_lm_head(
        model.lm_head,
        ops.of(model),
        hidden,
        plan=batch.plan,
        labels=batch.labels,
        input_ids=batch.input_ids,
        request=HeadRequest(logits=False),
        kwargs=batch.head_kwargs,
    )
    (head.loss * scale if scale != 1.0 else head.loss).backward()
    return head.loss.detach()


def model_step(model, ids, cu, max_len, *, scale: float = 1.0, zero: bool = True) -> torch.Tensor:
    """The model's own training step (its forward builds the plan), gradients kept as in `static_step`."""
    if zero:
        zero_grads(model)
    out = model(
        input_ids=ids, labels=boundary_labels(ids, cu), return_logits=False, **packed_kwargs(cu, max_len)
    )
    (out.loss * scale if scale != 1.0 else out.loss).backward()
    return out.loss.detach()


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def largest_difference(a: dict, b: dict) -> tuple[float, str]:
    """(max |a - b| over every gradient, the parameter where it is); (0.0, '') when bit-equal."""
    worst, where = 0.0, ""
    for name, value in b.items():
        if name not in a:
            return float("inf"), f"{name} (missing)"
        diff = (a[name].float() - value.float()).abs().max().item()
        if diff > worst or math.isnan(diff):
            worst, where = diff, name
    return worst, where
