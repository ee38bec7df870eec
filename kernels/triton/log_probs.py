"""Per-token log-probs (and entropy) of the LM head for a scoring pass, with no host sync.

A scoring pass (the old-policy or reference log-probs of RL, under `no_grad`) only needs, per row, the
log-sum-exp of its logits and the logit of its target. liger's fused linear cross-entropy counts the
valid targets on the host first (one `.item()`, a sync that waits for the whole forward), so a loop of
scoring calls cannot queue the next call while the device runs this one. Here the logits of a chunk of
rows come from one GEMM in the input dtype (as liger's do), and one Triton pass per row reads them once:
an online max and sum of exponentials in fp32, the target's logit, and for the entropy the sum of
p * logit. Nothing is read back to the host.

A call that needs gradients goes to the `chunked` reference (logits recomputed in the backward): this
backend is for scoring, and a training step on the GPU uses liger.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.cross_entropy import _from_logits, chunked
from ._common import next_pow2, precision_for

# logits of at most this many elements exist at once (a chunk of rows: 512 MiB in bf16, about 1800 rows at a 150k
# vocabulary: a scoring pass holds no activations for a backward, and fewer, larger GEMMs launch less)
CHUNK_ELEMENTS = 1 << 28
MAX_BLOCK = 8192  # vocabulary entries a program reads per step


@triton.jit
def row_log_probs_kernel(logits, stride, targets, nll, entropy, V, ignore_index, BV: tl.constexpr,
                         ENTROPY: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    m = tl.full((), float("-inf"), ACC)  # running max, sum of exp(x - m), sum of exp(x - m) * x
    s = tl.zeros((), ACC)
    t = tl.zeros((), ACC)
    for start in range(0, V, BV):
        o = start + tl.arange(0, BV)
        inside = o < V
        x = tl.load(base + o, mask=inside, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.where(inside, tl.exp(x - m_new), 0.0)
        s = s * scale + tl.sum(e, axis=0)
        if ENTROPY:
            t = t * scale + tl.sum(e * tl.where(inside, x, 0.0), axis=0)  # not e * x: 0 * -inf past the end
        m = m_new
    lse = m + tl.log(s)
    y = tl.load(targets + row)
    valid = y != ignore_index
    x_y = tl.load(base + tl.where(valid, y, 0)).to(ACC)
    tl.store(nll + row, tl.where(valid, lse - x_y, 0.0))
    if ENTROPY:
        tl.store(entropy + row, lse - t / s)


def row_log_probs(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, return_entropy: bool = False):
    """``(nll [N], entropy [N] or None)`` of logits ``[N, V]`` (any float dtype, rows contiguous) against
    ``targets [N]``: nll is log-sum-exp minus the target's logit, 0 where the target is ignored; entropy is
    of every row. Statistics in fp32 (fp64 for fp64 logits)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    acc = precision_for(logits.dtype)
    nll = torch.empty(rows, dtype=acc.acc_torch, device=logits.device)
    entropy = torch.empty_like(nll) if return_entropy else nll  # unused when not asked
    if rows:
        row_log_probs_kernel[(rows,)](
            logits, logits.stride(0), targets.contiguous(), nll, entropy, vocab, ignore_index,
            BV=min(MAX_BLOCK, next_pow2(vocab)), ENTROPY=return_entropy, ACC=acc.acc, num_warps=8,
        )
    return nll, (entropy if return_entropy else None)


def row_log_probs_reference(logits, targets, ignore_index: int = -100, return_entropy: bool = False):
    """The same from a full log-softmax (`reference/cross_entropy.py`)."""
    out = _from_logits(logits, targets, ignore_index, return_entropy)
    return out if return_entropy else (out, None)


def cross_entropy(hidden, weight, labels, *, ignore_index=-100, return_entropy=False):
    """The `cross_entropy` slot: ``(nll [N], entropy [N] or None)`` of hidden rows ``[N, d]`` under the head
    ``weight [V, d]``; the logits a chunk of rows at a time, never all at once. With gradients wanted, the
    `chunked` reference (this backend is for scoring passes)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return chunked(hidden, weight, labels, ignore_index=ignore_index, return_entropy=return_entropy)
    step = max(1, CHUNK_ELEMENTS // max(1, weight.shape[0]))
    nll, entropy = [], []
    for start in range(0, hidden.shape[0], step):
        logits = hidden[start : start + step] @ weight.T
        a, b = row_log_probs(logits, labels[start : start + step], ignore_index, return_entropy)
        nll.append(a)
        entropy.append(b)
    if not nll:
        empty = hidden.new_zeros(0, dtype=precision_for(hidden.dtype).acc_torch)
        return empty, (empty if return_entropy else None)
    joined = torch.cat(nll) if len(nll) > 1 else nll[0]
    if not return_entropy:
        return joined, None
    return joined, torch.cat(entropy) if len(entropy) > 1 else entropy[0]
