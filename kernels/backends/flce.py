"""How we call liger's fused linear cross-entropy: chunk sizing, and arguments passed by name.

Liger sizes its chunks to the hidden width: about ``vocab / hidden`` chunks (60 for Qwen3.5) whatever
the number of rows, and each chunk reads and rewrites the whole ``[vocab, hidden]`` weight gradient.
On an H200 that is a fixed 30-45 ms and some 500 kernel launches per training step, which a
shared-prefix step (a few thousand rows) cannot hide. We size chunks by rows instead, through
liger's ``chunk_mem_const`` (its budget of transient logits, in units of ``rows x hidden``).
"""

from __future__ import annotations

import functools
import inspect

# At most about twice this many rows of logits at a time (liger rounds chunks up to a power of
# two): 2048 x 151936 bf16 logits are 0.6 GB, small next to a step's activations, while a step of
# 6144 rows takes 6 chunks instead of 48.
LOGIT_ROWS_PER_CHUNK = 1024


def chunk_mem_const(rows: int, hidden: int, vocab: int, rows_per_chunk: int = LOGIT_ROWS_PER_CHUNK) -> int:
    """Liger's ``chunk_mem_const`` for about ``ceil(rows / rows_per_chunk)`` chunks.

    Liger takes ``ceil(vocab / (c * hidden))`` chunks' worth of splitting; choosing ``c`` as the
    smallest value that asks for no more than ``ceil(rows / rows_per_chunk)`` splits keeps both the
    chunk count and the transient logits bounded. ``c`` is at least 1, so beyond about
    ``vocab / hidden * rows_per_chunk`` rows (60k for Qwen3.5-4B) liger's own chunking applies.
    """
    chunks = max(1, -(-rows // rows_per_chunk))
    return max(1, -(-vocab // (hidden * chunks)))


@functools.cache
def _parameters(forward) -> tuple[inspect.Parameter, ...]:
    """``forward``'s parameters after ``ctx``, read once: the call sits on every training step."""
    return tuple(inspect.signature(forward).parameters.values())[1:]


def positional_arguments(forward, **given) -> list:
    """``given`` as positional arguments of an ``autograd.Function.forward`` (after ``ctx``), defaults
    filling the gaps; names the installed version does not have are left out, so an older release
    without ``chunk_mem_const`` still works (with its own chunking)."""
    params = _parameters(forward)
    names = [p.name for p in params]
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in given]
    if missing:
        raise TypeError(f"{forward.__qualname__} needs {missing}")
    last = max(names.index(name) for name in given if name in names)
    return [given.get(p.name, p.default) for p in params[: last + 1]]
