"""Every GDN round of a layer in one autograd node, on a backend's own forward and backward stages.

The per-round loop in `gdn.py` calls the backend's public function once per level: each call
validates its inputs again, normalises q and k again, gathers five inputs again and becomes its own
autograd node, whose backward scatters five gradients again. Here the whole layer is one node:

  forward:  one gather per input for every round (`GDNIndex.src`), one l2norm of q and of k, the
            backend's forward stage per round (states handed down by `state_index`), one gather of
            the kept outputs;
  backward: rounds in reverse, each round's `dh0` scattered onto the previous round's final states
            as its `dht`, one l2norm backward each for q and k, one scatter-add per input.

When the plan says the rounds read the compact row in order (`GDNIndex.src_identity`: chunk-aligned
prefixes of one group) and their outputs are it (`out_identity`), the gathers and scatters are left
out: each round is a slice of the row, each gradient the rounds' own.

Every round runs the very kernels the public function runs on the very rows, and l2norm is a
per-row operation, so the forward is bit-identical to the loop's; gradients differ from it only in
the order in which a replayed tail row's contributions are summed.

A backend offers this by giving its `gated_delta_rule` function a `rounds` attribute that follows
`RoundKernels`; a backend without one takes the loop. Stages that also follow `JointRounds` run the
stages that do not read the state once over every round's rows (`GDNIndex.joint`), and only the
state recurrence and what reads it per round; the state hand-over between rounds stays here
(`initial_state`, `final_state_grad`). Without them every stage runs once per round
(`loop_forward`, `loop_backward`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .gdn import GDNIndex, GDNRound


class RoundKernels(Protocol):
    """A GDN backend's stages on `[1, rows, heads, dim]` tensors of one round (varlen by `rnd`).

    A backend may also offer `forward_rounds` and `backward_rounds` (`JointRounds`): the stages
    that do not read the state once over every round's rows; without them the rounds loop over
    `forward` and `backward` (`loop_forward`, `loop_backward`)."""

    def l2norm_fwd(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, rstd): x (contiguous, as every stage's inputs) normalised over its last dimension."""

    def l2norm_bwd(self, y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """dx in `dtype`."""

    def forward(self, q, k, v, g, beta, scale: float, h0, rnd: GDNRound) -> tuple:
        """(o in v's dtype, final states or None, saved tensors for `backward`)."""

    def backward(self, q, k, v, g, beta, scale: float, h0, saved: tuple, do, dht, rnd: GDNRound) -> tuple:
        """(dq, dk, dv, dg, dbeta, dh0 or None): dq and dk before the l2norm backward, if any."""


class JointRounds(Protocol):
    """Every round of a layer at once, on `[1, rows, ...]` tensors holding every round's rows in order
    (`idx.present` says which rows are whose, `idx.joint` is their chunk tables as one varlen row).

    The state hand-over stays the caller's: `h0_of(rnd, states)` is a round's initial states from the
    previous round's final states (None before the first), `dht_of(i, dh0)` the previous round's
    `dht` from round i's `dh0` (None when nothing flows back)."""

    def forward_rounds(self, q, k, v, g, beta, scale: float, idx: GDNIndex, h0_of) -> tuple:
        """(o for every row, each round's initial states, saved tensors, saved non-tensors)."""

    def backward_rounds(self, q, k, v, g, beta, scale: float, idx: GDNIndex, initial, saved: tuple, meta,
                        do, dht_of) -> tuple:
        """(dq, dk, dv, dg, dbeta) for every row: dq and dk before the l2norm backward, if any."""


def round_kernels(gdn_fn, dtype: torch.dtype) -> RoundKernels | None:
    """The stages behind an op table's `gated_delta_rule` for inputs of `dtype`, if its backend has them."""
    function_for = getattr(gdn_fn, "function_for", None)  # a DtypeDispatch slot: the backend serving this dtype
    fn = gdn_fn if function_for is None else function_for(dtype)
    return getattr(fn, "rounds", None)


def initial_state(rnd: GDNRound, states, like: torch.Tensor, k_dim: int) -> torch.Tensor | None:
    """Round `rnd`'s initial states, picked from the previous round's final `states`."""
    if states is None:
        # no round 0 (every root shorter than one chunk): the level-1 sequences start from zeros
        return None if rnd.state_index is None else like.new_zeros(
            (rnd.num_sequences, like.shape[2], k_dim, like.shape[3]),
            dtype=torch.promote_types(like.dtype, torch.float32),
        )
    if rnd.zero_state:
        states = torch.cat([states.new_zeros((1, *states.shape[1:])), states])
    return states.index_select(0, rnd.state_index)


def final_state_grad(rnd: GDNRound, prev: GDNRound, dh0: torch.Tensor) -> torch.Tensor:
    """The previous round's `dht`: round `rnd`'s `dh0` summed onto the states it was picked from."""
    zero = 1 if rnd.zero_state else 0
    dstates = dh0.new_zeros((prev.num_sequences + zero, *dh0.shape[1:]))
    dstates.index_add_(0, rnd.state_index, dh0)
    return dstates[zero:]


def loop_forward(kernels: RoundKernels, q, k, v, g, beta, scale, idx: GDNIndex, h0_of) -> tuple:
    """`JointRounds.forward_rounds` from per-round stages: every stage once per round."""
    outputs, initial, saved, counts = [], [], [], []
    states = None
    for rnd, rows in idx.present:
        h0 = h0_of(rnd, states)
        o, states, kept = kernels.forward(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows],
                                          scale, h0, rnd)
        outputs.append(o)
        initial.append(h0)
        saved.extend(kept)
        counts.append(len(kept))
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return o, initial, tuple(saved), counts


def loop_backward(kernels: RoundKernels, q, k, v, g, beta, scale, idx: GDNIndex, initial, saved, counts,
                  do, dht_of) -> tuple:
    """`JointRounds.backward_rounds` from per-round stages: rounds in reverse, every stage once per round."""
    present = idx.present
    kept, at = [], 0
    for n in counts:
        kept.append(tuple(saved[at : at + n]))
        at += n
    grads = [None] * len(present)
    dht = None
    for i in range(len(present) - 1, -1, -1):
        rnd, rows = present[i]
        *grads[i], dh0 = kernels.backward(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows],
                                          scale, initial[i], kept[i], do[:, rows], dht, rnd)
        dht = dht_of(i, dh0)
    return tuple(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in zip(*grads))


def rounds_forward(kernels: RoundKernels, idx: GDNIndex, scale: float, l2norm: bool, q, k, v, g, beta) -> tuple:
    """Every round's forward: (the compact row's outputs, what `GDNRounds.backward` reads)."""
    if idx.src_identity:
        # the rounds read the compact row in place; the stages take contiguous rows (fla's l2norm
        # views them flat), so q, k, v split from the conv output are copied, g and beta are not
        qs, ks, vs, gs, bs = (x.contiguous() for x in (q, k, v, g, beta))
    else:
        qs, ks, vs, gs, bs = (x.index_select(1, idx.src) for x in (q, k, v, g, beta))
    q_rstd = k_rstd = None
    if l2norm:
        qs, q_rstd = kernels.l2norm_fwd(qs)
        ks, k_rstd = kernels.l2norm_fwd(ks)

    def h0_of(rnd, states):
        return initial_state(rnd, states, vs, ks.shape[3])

    joint = getattr(kernels, "forward_rounds", None) if idx.joint is not None else None
    if joint is not None:  # an index built without joint tables takes the loop, same results
        o, initial, saved, meta = joint(qs, ks, vs, gs, bs, scale, idx, h0_of)
    else:
        o, initial, saved, meta = loop_forward(kernels, qs, ks, vs, gs, bs, scale, idx, h0_of)
    out = o if idx.out_identity else o.index_select(1, idx.out_index)
    return out, (qs, ks, vs, gs, bs, q_rstd, k_rstd, initial, saved, meta, joint is not None)


class GDNRounds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels: RoundKernels, idx: GDNIndex, scale: float, l2norm: bool, q, k, v, g, beta):
        out, kept = rounds_forward(kernels, idx, scale, l2norm, q, k, v, g, beta)
        qs, ks, vs, gs, bs, q_rstd, k_rstd, initial, saved, meta, ctx.joint = kept
        # states travel through the saved tensors; None entries are kept as None by autograd
        ctx.rounds = len(initial)
        ctx.meta = meta
        ctx.save_for_backward(qs, ks, vs, gs, bs, q_rstd, k_rstd, *initial, *saved)
        ctx.kernels, ctx.idx, ctx.scale, ctx.l2norm = kernels, idx, scale, l2norm
        ctx.dtypes = (q.dtype, k.dtype)
        ctx.shapes = (q.shape, k.shape, v.shape, g.shape, beta.shape)
        return out

    @staticmethod
    def backward(ctx, do):
        kernels, idx, scale = ctx.kernels, ctx.idx, ctx.scale
        qs, ks, vs, gs, bs, q_rstd, k_rstd, *rest = ctx.saved_tensors
        initial, saved = rest[: ctx.rounds], tuple(rest[ctx.rounds :])
        # outputs of replayed tail rows were dropped: their gradient is zero
        if idx.out_identity:
            d_out = do.contiguous()
        else:
            d_out = do.new_zeros((1, qs.shape[1], *do.shape[2:])).index_copy_(1, idx.out_index, do.contiguous())
        present = idx.present

        def dht_of(i, dh0):
            rnd = present[i][0]
            if i == 0 or rnd.state_index is None or dh0 is None or initial[i] is None:
                return None
            return final_state_grad(rnd, present[i - 1][0], dh0)

        joint = kernels.backward_rounds if ctx.joint else None
        args = (qs, ks, vs, gs, bs, scale, idx, initial, saved, ctx.meta, d_out, dht_of)
        dq, dk, dv, dg, db = joint(*args) if joint is not None else loop_backward(kernels, *args)
        if ctx.l2norm:
            dq = kernels.l2norm_bwd(qs, q_rstd, dq, ctx.dtypes[0])
            dk = kernels.l2norm_bwd(ks, k_rstd, dk, ctx.dtypes[1])
        out = []
        for grad, shape, like in zip((dq, dk, dv, dg, db), ctx.shapes, (qs, ks, vs, gs, bs)):
            if idx.src_identity:  # every compact row fed exactly one round row: its gradient is that row's
                out.append(grad.to(like.dtype).reshape(shape))
                continue
            full = grad.new_zeros(shape, dtype=like.dtype)
            out.append(full.index_add_(1, idx.src, grad.to(like.dtype)))
        return (None, None, None, None, *out)


def gated_delta_rule_rounds(
    kernels: RoundKernels, idx: GDNIndex, q, k, v, g, beta, scale: float, l2norm: bool
) -> torch.Tensor:
    """Gated DeltaNet over the compact row, every round in one autograd node; returns `[1, C, HV, V]`."""
    return GDNRounds.apply(kernels, idx, scale, l2norm, q, k, v, g, beta)


class ReferenceRounds:
    """`RoundKernels` from any public `gated_delta_rule` function (a float64 reference, say): the naive
    counterpart of a backend's stages. Backward recomputes the round under autograd."""

    def __init__(self, gdn_fn, eps: float = 1e-6):
        self.fn, self.eps = gdn_fn, eps

    @property
    def plan_tables(self) -> bool:
        """The public function gets the plan's `cu_seqlens` and `chunk_indices` only: fine for a padded plan
        when it keeps nothing derived from them (`table_free`)."""
        return getattr(self.fn, "table_free", False)

    def l2norm_fwd(self, x):
        rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + self.eps)
        return x * rstd, rstd

    def l2norm_bwd(self, y, rstd, dy, dtype):
        return (rstd * (dy - y * (dy * y).sum(-1, keepdim=True))).to(dtype)

    def _run(self, q, k, v, g, beta, scale, h0, rnd):
        return self.fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=rnd.export_state,
                       cu_seqlens=rnd.cu_seqlens, cu_seqlens_cpu=rnd.cu_seqlens_cpu, chunk_indices=rnd.chunk_indices)

    def forward(self, q, k, v, g, beta, scale, h0, rnd):
        o, final = self._run(q, k, v, g, beta, scale, h0, rnd)
        return o, final, ()

    def backward(self, q, k, v, g, beta, scale, h0, saved, do, dht, rnd):
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
            state = None if h0 is None else h0.detach().requires_grad_()
            o, final = self._run(*leaves, scale, state, rnd)
            outputs, grads = [o], [do]
            if dht is not None:
                outputs.append(final)
                grads.append(dht)
            inputs = leaves + ([] if state is None else [state])
            found = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
        found = [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, found)]
        return (*found[:5], found[5] if state is not None else None)
