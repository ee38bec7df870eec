"""The plans of the last few micro-batches, handed out again when the same batch comes back.

An RL step runs one micro-batch several times: the reference model's log-probs, the old policy's, then the
training forward (once per iteration). Each run would build the same plan, and while the host builds it the
device waits (the plan needs the token ids on the host, so nothing is queued yet). `PlanReuse` keeps the last
`size` plans with what they were built from, and `build_plan` returns a kept plan only when the batch is the
same **by value**: its host copy (the one device-to-host copy the plan makes anyway) equals the kept one array
by array (ids, boundaries, position rows), and so does every knob of `build_plan` and the device. Identity,
addresses or version counters are never trusted: a buffer refilled in place, another model's knobs or a newly
held bucket all build anew. Plans are immutable (frozen, their index tensors only read), so handing one out
twice is safe; the kept plans hold their device indices (a few MB each at 64k tokens).

`shared_prefix_plan_reuse` (config, default on) turns it off for a model.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .level_cost import resolve_level_cost
from .plan import _to_host, build_plan


class PlanReuse:
    """The last `size` (knobs, host arrays, plan) triples, most recent first."""

    def __init__(self, size: int = 4):
        self.size = size
        self.entries: list[tuple[tuple, tuple, object]] = []
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()  # one table for the process: models may run in several threads

    def find(self, knobs: tuple, arrays: tuple) -> tuple[bool, object]:
        """(True, the kept plan, None included) for a batch equal in every array and knob, else (False, None)."""
        with self._lock:
            for i, (kept_knobs, kept_arrays, plan) in enumerate(self.entries):
                if kept_knobs == knobs and _same(kept_arrays, arrays):
                    self.entries.insert(0, self.entries.pop(i))
                    self.hits += 1
                    return True, plan
            self.misses += 1
            return False, None

    def keep(self, knobs: tuple, arrays: tuple, plan) -> None:
        # copies: on the CPU the host arrays are views of the caller's tensors, which may be refilled later
        owned = tuple(None if a is None else np.array(a, copy=True) for a in arrays)
        with self._lock:
            self.entries.insert(0, (knobs, owned, plan))
            del self.entries[self.size :]

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()


def _same(kept: tuple, arrays: tuple) -> bool:
    if len(kept) != len(arrays):
        return False
    for a, b in zip(kept, arrays):
        if (a is None) != (b is None):
            return False
        if a is not None and (a.shape != b.shape or not np.array_equal(a, b)):
            return False
    return True


def build_or_reuse(
    reuse: PlanReuse | None, input_ids, cu_seqlens, position_ids=None, build=build_plan, device=None, **knobs
):
    """`build(input_ids, cu_seqlens, position_ids, **knobs)` (`build_plan`), or the plan `reuse` kept for an equal
    batch.

    The batch is copied to the host once here (what `build_plan` would copy) and the plan is built from that
    copy for `device` (default: the batch's). The key holds the knobs and the level cost they resolve to (the
    environment and the measured table can change it)."""
    device = input_ids.device if device is None else torch.device(device)
    if reuse is None:
        return build(input_ids, cu_seqlens, position_ids, device=device, **knobs)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or (position_ids is not None and position_ids.shape[-1] != input_ids.shape[-1]):
        return build(input_ids, cu_seqlens, position_ids, device=device, **knobs)  # its own error names the bad shape
    rows = None if position_ids is None else position_ids.reshape(-1, input_ids.shape[-1])
    bounds, ids, pos = _to_host(cu_seqlens, input_ids, rows)
    deep = knobs.get("max_depth", 1) > 1
    cost = resolve_level_cost(device, knobs.get("level_cost")).rows if deep else None
    # the compact positions keep the dtype of the batch's: equal values of another dtype are another plan
    shape = None if position_ids is None else (tuple(position_ids.shape), position_ids.dtype)
    # not the bucket gate ("auto": replay or eager by measured time, one per mode): a kept plan, padded or not, gives
    # every forward the same rows, and keeps the way chosen when it was built
    key = (device, shape, tuple(sorted((k, v) for k, v in knobs.items() if k != "bucket_gate")), cost)
    arrays = (bounds, ids, pos)
    found, plan = reuse.find(key, arrays)
    if found:
        return plan
    # the host copy is int64; the plan's compact positions take the batch's own dtype, as a direct build's do
    host_positions = None if pos is None else torch.from_numpy(pos).reshape(position_ids.shape).to(position_ids.dtype)
    # a kept plan serves forwards of any mode: built from an inference-mode forward (an RL step's reference
    # log-probs) its tensors would be inference tensors, which the training forward of the batch cannot save
    with torch.inference_mode(False):
        plan = build(torch.from_numpy(ids).reshape(1, -1), torch.from_numpy(bounds), host_positions, device=device,
                     **knobs)
    reuse.keep(key, arrays, plan)
    return plan


PLANS = PlanReuse()  # one for the process: a plan does not depend on the weights, so a reference model reuses it too
