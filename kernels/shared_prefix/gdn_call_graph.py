"""A scoring forward's GDN rounds captured once and replayed for every GDN layer of that forward.

Every GDN layer of one forward runs its rounds on the same plan (the same chunk tables, the same state
hand-over) with inputs of the same shapes; only the values differ, and the rounds read no weight. Run
eagerly, each layer launches its stages through fla's (or our) Python wrappers and Triton's launcher:
on the H200 about as much host time per layer as the layer's GPU work at n=4 P=2048, which makes an
eager scoring forward host-bound (docs/bench/README.md, the log-prob pass's host profile). Here the
first GDN layer of a forward runs eagerly (any compile or autotuning happens there, never under a
capture), the second captures the rounds on static copies of its inputs and replays them, and every
later layer copies its inputs in and replays: five copies and one graph launch per layer.

A replay runs the captured kernels with the captured launch parameters on the same rows, so its output
is the eager call's bit for bit. It applies only where nothing needs the rounds' autograd node (a scoring
forward: `no_grad`, `inference_mode`, or inputs that want no gradient), on CUDA, outside another capture
(the layer-stack graphs of `shared_prefix_cuda_graphs` capture these same rounds themselves), and on
stages that read every chunk table from the plan (`plan_tables`: nothing cached by tensor identity
that a graph could outlive). One graph is kept, the last forward's: its inputs, outputs and working
memory (a few hundred MB at 4B widths and 6k rows) stay allocated until the next forward with another
plan replaces it or `release()` drops it. ``PATCHGEN_GDN_CALL_GRAPHS=0`` turns it off (A/B runs).
"""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass

import torch

from .gdn_rounds import rounds_forward


class CallGraphUnavailable(UserWarning):
    """A GDN call graph could not be captured: this process's scoring forwards run the rounds eagerly."""


@dataclass
class _Entry:
    key: tuple
    idx: object  # the plan's GDNIndex: held, so that `key`'s id of it stays its own
    kernels: object
    statics: list[torch.Tensor]
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor


def _key(kernels, idx, scale: float, l2norm: bool, inputs) -> tuple:
    shapes = tuple((x.shape, x.dtype) for x in inputs)
    return (id(kernels), id(idx), scale, l2norm, shapes, inputs[0].device, torch.is_inference_mode_enabled())


class GDNCallGraphs:
    """The last scoring forward's GDN call graph (see the module docstring)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.entry: _Entry | None = None
        self._seen: tuple | None = None  # the key last run eagerly, with a weak reference to its index
        self.captures = self.replays = 0  # for reports and tests

    def applies(self, kernels, inputs) -> bool:
        q = inputs[0]
        return (
            self.enabled
            and q.is_cuda
            and getattr(kernels, "plan_tables", False)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs))
            and not torch.cuda.is_current_stream_capturing()
        )

    def release(self) -> None:
        """Drop the kept graph and its memory."""
        self.entry = None
        self._seen = None

    def run(self, kernels, idx, scale: float, l2norm: bool, inputs) -> torch.Tensor | None:
        """The rounds' output from a replay, or None where the caller runs them eagerly (a forward's first layer)."""
        key = _key(kernels, idx, scale, l2norm, inputs)
        entry = self.entry
        if entry is None or entry.key != key:
            seen = self._seen
            if seen is None or seen[0] != key or seen[1]() is not idx:
                self._seen = (key, weakref.ref(idx))
                return None
            self.entry = None  # the last forward's graph goes before this one is captured
            entry = self._capture(key, kernels, idx, scale, l2norm, inputs)
            if entry is None:
                return None
            self.entry = entry
        torch._foreach_copy_(entry.statics, list(inputs))
        entry.graph.replay()
        self.replays += 1
        return entry.out.clone()

    def _capture(self, key, kernels, idx, scale, l2norm, inputs) -> _Entry | None:
        device = inputs[0].device
        statics = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in inputs]
        torch._foreach_copy_(statics, list(inputs))
        side, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                # thread_local: a capture on this thread fails only on what this thread does
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out, _ = rounds_forward(kernels, idx, scale, l2norm, *statics)
                finally:
                    graph.capture_end()
        except Exception as error:  # noqa: BLE001 - any failed capture leaves the eager rounds, which work
            self.enabled = False
            warnings.warn(
                f"the GDN rounds of a scoring forward could not be captured into a CUDA graph ({error}); they run "
                "eagerly from now on (set PATCHGEN_GDN_CALL_GRAPHS=0 to skip the attempt)",
                CallGraphUnavailable,
                stacklevel=2,
            )
            return None
        current.wait_stream(side)
        self.captures += 1
        return _Entry(key, idx, kernels, statics, graph, out)


CALL_GRAPHS = GDNCallGraphs(enabled=os.environ.get("PATCHGEN_GDN_CALL_GRAPHS") != "0")
