"""Row-invariance checks of single ops: is a row's result the same whatever else is in the call?

Shared-prefix execution runs every op of the packed row on fewer rows (the compact row, `C` of
`T`), and the mixers on other segmentations of the same rows. Flag on equals flag off bit for bit
only if every op gives a row the same bits however many rows share the call (a GEMM with `M = C`
rows against `M = T`), and however its sequence is batched (one sequence alone against the varlen
batch; a suffix's queries alone against its whole sequence; a GDN run split at a chunk boundary).
Each check here feeds one op identical rows in two such calls and compares the rows it returns.

Used by `bf16_departure.py`: `--probe` runs them on random inputs at the model's widths, and the
model run replays them on the recorded inputs of the first op where shared and packed depart.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Check:
    """One comparison: `a` (the call under test) against `b` (the packed call), row for row."""

    name: str
    max_abs: float
    rel: float
    equal: bool

    def line(self) -> str:
        verdict = "bit-equal" if self.equal else f"DIFFERS max {self.max_abs:.3e} rel {self.rel:.3e}"
        return f"{self.name}: {verdict}"


def compare(name: str, a: torch.Tensor, b: torch.Tensor) -> Check:
    """Max |a - b|, ||a - b|| / ||b|| (float32) and bitwise equality of two same-shaped tensors.

    In slices of a few million elements: logits of a long packed row would need several float32
    copies of `[T, vocab]` at once otherwise.
    """
    if a.shape != b.shape:
        raise ValueError(f"{name}: cannot compare a {tuple(a.shape)} tensor with a {tuple(b.shape)} one")
    if a.dtype != b.dtype:
        raise ValueError(f"{name}: cannot compare {a.dtype} with {b.dtype} bit for bit")
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    worst, diff_sq, ref_sq = 0.0, 0.0, 0.0
    for start in range(0, x.numel(), _SLICE):
        xs, ys = x[start : start + _SLICE].double(), y[start : start + _SLICE].double()
        d = xs - ys
        worst = max(worst, d.abs().max().item())
        diff_sq += d.square().sum().item()
        ref_sq += ys.square().sum().item()
    rel = diff_sq**0.5 / ref_sq**0.5 if ref_sq > 0 else (0.0 if diff_sq == 0 else float("inf"))
    return Check(name, worst, rel, bool(torch.equal(x, y)))


_SLICE = 1 << 24


# ---- the compact row and the packed row of one tensor ---------------------------------------------


def token_dim(shape, length: int) -> int | None:
    """The dim holding the `length` token rows (dim 1 first, as in `[1, T, ...]`, then 0, then the rest)."""
    for dim in [d for d in (1, 0) if d < len(shape)] + list(range(2, len(shape))):
        if shape[dim] == length:
            return dim
    return None


def compact_like(plan, x: torch.Tensor) -> torch.Tensor:
    """`x` in packed layout (`T` rows on some dim, or `[T * k, ...]` flattened) to the compact row."""
    dim = token_dim(x.shape, plan.packed_length)
    if dim is not None:
        return plan.compact(x, dim)
    if x.dim() and x.shape[0] % plan.packed_length == 0:
        k = x.shape[0] // plan.packed_length
        rows = plan.compact(x.reshape(plan.packed_length, k, *x.shape[1:]), 0)
        return rows.reshape(plan.compact_length * k, *x.shape[1:])
    raise ValueError(
        f"no dim of a {tuple(x.shape)} tensor holds the packed row's {plan.packed_length} tokens"
    )


def expand_like(plan, x: torch.Tensor, packed_shape) -> torch.Tensor | None:
    """`x` in compact layout back to `packed_shape` (every packed row of a node reads the node's
    compact row); None when `x` is not a per-token tensor of that shape."""
    t, c = plan.packed_length, plan.compact_length
    packed_shape = tuple(packed_shape)
    if x.dim() == len(packed_shape) + 1 and x.shape[0] == 1:  # `[1, C, ...]` against `[T, ...]`
        x = x.squeeze(0)
    if x.dim() != len(packed_shape):
        return None
    for dim in range(x.dim()):
        if (
            x.shape[dim] == c
            and packed_shape[dim] == t
            and tuple(x.shape[:dim]) == packed_shape[:dim]
            and tuple(x.shape[dim + 1 :]) == packed_shape[dim + 1 :]
        ):
            return plan.expand(x, dim)
    if (
        x.dim()
        and x.shape[0] % c == 0
        and packed_shape[0] == x.shape[0] // c * t
        and tuple(x.shape[1:]) == packed_shape[1:]
    ):
        k = x.shape[0] // c
        return plan.expand(x.reshape(c, k, *x.shape[1:]), 0).reshape(packed_shape)
    if tuple(x.shape) == packed_shape:  # not per token (a weight, a scalar): compared as it is
        return x
    return None


# ---- one op, two calls ------------------------------------------------------------------------


def token_rows(name: str, fn, args: tuple, plan) -> Check:
    """A token-wise op (GEMM, norm, MLP) on the packed rows (`M = T`) and on the compact rows (`M = C`).

    Every tensor argument with the packed row's tokens is compacted; the `M = C` result, expanded
    back, is compared with the `M = T` one.
    """
    # each call gets its own copies: an op that writes its inputs (liger's rotary rotates q and k in
    # place) would otherwise hand the second call rows it had already rotated
    whole = fn(*(_copy(a) for a in args))
    compacted = tuple(_compact_or_keep(plan, _copy(a)) for a in args)
    part = fn(*compacted)
    return compare(
        f"{name} M=C vs M=T rows", expand_like(plan, _first(part), _first(whole).shape), _first(whole)
    )


def _copy(a):
    return a.clone() if isinstance(a, torch.Tensor) else a


def _compact_or_keep(plan, a):
    if not isinstance(a, torch.Tensor):
        return a
    try:
        return compact_like(plan, a)
    except ValueError:
        return a  # a weight: the same for both calls


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return [(s, e) for s, e in itertools.pairwise(bounds) if e > s]


def _one(length: int, device) -> torch.Tensor:
    return torch.tensor([0, length], dtype=torch.int32, device=device)


def _alone_checks(op: str, packed: torch.Tensor, cu, run_alone) -> list[Check]:
    """`op` on each sequence alone, as a varlen batch of one and with no boundaries, vs inside the
    varlen batch (`packed`); `run_alone(s, e, varlen)` is the op on rows `[s, e)`."""
    checks = []
    for how, varlen in (("a varlen batch of one", True), ("no cu_seqlens", False)):
        alone = torch.cat([run_alone(s, e, varlen) for s, e in spans(cu)], dim=1)
        checks.append(
            compare(f"{op} one sequence alone ({how}) vs in the varlen batch", alone, packed[:, : alone.shape[1]])
        )
    return checks


def conv_alone(conv_fn, x, weight, bias, activation, cu) -> list[Check]:
    """Causal conv1d: each sequence alone, as a varlen batch of one and with no boundaries (`[1, L, D]`),
    vs inside the varlen batch."""
    packed = conv_fn(x, weight, bias, activation=activation, cu_seqlens=cu)

    def run_alone(s, e, varlen):
        one = _one(e - s, x.device) if varlen else None
        return conv_fn(x[:, s:e], weight, bias, activation=activation, cu_seqlens=one)

    return _alone_checks("causal_conv1d", packed, cu, run_alone)


def conv_shared(conv_fn, x, weight, bias, activation, cu, plan) -> Check:
    """Causal conv1d as the shared path calls it (prefixes once, look-back rows) vs packed."""
    from patchgen.kernels.shared_prefix import shared_prefix_causal_conv1d

    packed = conv_fn(x, weight, bias, activation=activation, cu_seqlens=cu)
    shared = shared_prefix_causal_conv1d(
        plan, conv_fn, plan.compact(x, 1), weight, bias, activation=activation
    )
    return compare("causal_conv1d shared-prefix call vs packed", plan.expand(shared, 1), packed)


def _gdn(gdn_fn, q, k, v, g, beta, **kwargs):
    out = gdn_fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kwargs)
    return out if isinstance(out, tuple) else (out, None)


def gdn_alone(gdn_fn, q, k, v, g, beta, cu, chunk_indices=None) -> list[Check]:
    """Gated delta rule: each sequence alone, as a varlen batch of one and with no `cu_seqlens`, vs
    inside the varlen batch."""
    packed, _ = _gdn(gdn_fn, q, k, v, g, beta, **_varlen(cu, chunk_indices))

    def run_alone(s, e, varlen):
        kwargs = _varlen(_one(e - s, q.device)) if varlen else {}
        return _gdn(gdn_fn, *(t[:, s:e] for t in (q, k, v, g, beta)), **kwargs)[0]

    return _alone_checks("gated_delta_rule", packed, cu, run_alone)


def _varlen(cu, chunk_indices=None) -> dict:
    out = {"cu_seqlens": cu, "cu_seqlens_cpu": cu.cpu()}
    if chunk_indices is not None:
        out["chunk_indices"] = chunk_indices
    return out


def gdn_split(gdn_fn, q, k, v, g, beta, start: int, end: int, splits: list[int]) -> Check:
    """Gated delta rule on one sequence `[start, end)` (varlen batches of one, as the shared rounds
    call it): whole vs run in pieces cut at `splits` (chunk boundaries: where the rounds hand a
    node's state to its children), each piece's fp32 final state handed to the next call."""
    rows = [t[:, start:end] for t in (q, k, v, g, beta)]
    device, length = q.device, end - start
    whole, _ = _gdn(gdn_fn, *rows, **_varlen(_one(length, device)))
    pieces, state, cuts = [], None, [0, *splits, length]
    for lo, hi in itertools.pairwise(cuts):
        out, state = _gdn(
            gdn_fn,
            *(t[:, lo:hi] for t in rows),
            initial_state=state,
            output_final_state=hi < length,
            **_varlen(_one(hi - lo, device)),
        )
        pieces.append(out)
    return compare(
        f"gated_delta_rule split at rows {splits} of {length} (final state handed on) vs whole",
        torch.cat(pieces, 1),
        whole,
    )


def gdn_shared(gdn_fn, q, k, v, g, beta, cu, plan, chunk_indices=None) -> Check:
    """Gated delta rule as the shared path calls it (rounds over the tree) vs packed."""
    from patchgen.kernels.shared_prefix import shared_prefix_gated_delta_rule

    packed, _ = _gdn(gdn_fn, q, k, v, g, beta, **_varlen(cu, chunk_indices))
    shared = shared_prefix_gated_delta_rule(
        plan, gdn_fn, *(plan.compact(t, 1) for t in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True
    )
    return compare("gated_delta_rule shared-prefix rounds vs packed", plan.expand(shared, 1), packed)


def _attend(attn_fn, q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return attn_fn(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        scale=scale,
        causal=True,
    )


def attention_alone(attn_fn, q, k, v, cu, scale) -> Check:
    """Varlen causal attention (`[T, H, D]`): each sequence alone vs inside the varlen batch."""
    lengths = [e - s for s, e in spans(cu)]
    packed = _attend(attn_fn, q, k, v, cu, cu, max(lengths), max(lengths), scale)
    alone = torch.cat(
        [
            _attend(
                attn_fn,
                q[s:e],
                k[s:e],
                v[s:e],
                _one(e - s, q.device),
                _one(e - s, q.device),
                e - s,
                e - s,
                scale,
            )
            for s, e in spans(cu)
        ]
    )
    return compare("attention one sequence alone vs in the varlen batch", alone, packed[: alone.shape[0]])


def attention_rows(attn_fn, q, k, v, scale, start: int, end: int, offset: int, rows: int) -> Check:
    """Varlen causal attention of one sequence `[start, end)`: its rows `[offset, offset + rows)`
    queried alone against keys `[0, offset + rows)` (bottom-right causal: one segment of the shared
    path's call, a prefix when `offset` is 0) vs the same rows of the whole sequence's call (`q = k = L`)."""
    length = end - start

    def one(n):
        return _one(n, q.device)

    whole = _attend(
        attn_fn, q[start:end], k[start:end], v[start:end], one(length), one(length), length, length, scale
    )
    keys = offset + rows
    part = _attend(
        attn_fn,
        q[start + offset : start + keys],
        k[start : start + keys],
        v[start : start + keys],
        one(rows),
        one(keys),
        rows,
        keys,
        scale,
    )
    return compare(
        f"attention rows [{offset}, {keys}) alone (q={rows}, k={keys}) vs whole sequence (q=k={length})",
        part,
        whole[offset:keys],
    )


def attention_shared(attn_fn, q, k, v, cu, scale, plan) -> Check:
    """Varlen causal attention as the shared path calls it (compact queries, gathered keys) vs packed."""
    from patchgen.kernels.shared_prefix import shared_prefix_attention

    lengths = [e - s for s, e in spans(cu)]
    packed = _attend(attn_fn, q, k, v, cu, cu, max(lengths), max(lengths), scale)
    shared = shared_prefix_attention(
        plan, attn_fn, *(plan.compact(t, 0).unsqueeze(0) for t in (q, k, v)), scale=scale
    )
    return compare("attention shared-prefix call vs packed", plan.expand(shared.squeeze(0), 0), packed)


def member_path(plan) -> tuple[int, int, list[tuple[int, int, bool]]] | None:
    """(start, end, segments) of the first sequence that shares rows: its path through the tree,
    each segment `(offset in the sequence, rows, shared)` from the root down to its own leaf."""
    if not plan.nodes:
        return None
    layout = plan.layout
    member = plan.nodes[0].members[0]
    path = layout.path(int(layout.sequence_segment[member]))
    return (
        layout.cu[member],
        layout.cu[member + 1],
        [(seg.offset, seg.length, seg.shared) for seg in path if seg.length],
    )


def linear_rows(
    name: str, x: torch.Tensor, weight: torch.Tensor, plan, bias: torch.Tensor | None = None
) -> Check:
    """F.linear on the packed rows (`M = T`) and on the compact rows (`M = C`), compared row for row."""
    return token_rows(
        f"F.linear {name} [{weight.shape[1]}->{weight.shape[0]}]",
        lambda t: F.linear(t, weight, bias),
        (x,),
        plan,
    )
