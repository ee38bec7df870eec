"""Depthwise causal convolution over a packed row that never reads across a sequence start.

Upstream's fallback convolves the whole row, so the first ``W - 1`` tokens of a sequence see the
end of the previous one; here each tap is masked by the token's position within its sequence, and
reads the sequence's initial state there when one is given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import compute_dtype

ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d(
    x, weight, bias=None, *, activation="silu", cu_seqlens=None, initial_state=None, cu_seqlens_cpu=None,
    chunk_indices=None,
):
    """``y[t] = act(bias + sum_j weight[:, W-1-j] * x[t-j])`` over taps that stay inside t's sequence.

    ``x: [B, T, D]``, ``weight: [D, W]``; ``initial_state: [N, W-1, D]`` (one per sequence, rows in time
    order: row ``W-1-j`` is the input ``j`` rows before the sequence's first) is read by the taps
    before a sequence's start, which otherwise read zeros; its gradient flows. Computed in fp32
    (float64 for float64), returned in x's dtype. ``cu_seqlens_cpu`` and ``chunk_indices`` are accepted
    for the slot's signature and unused (the taps are masked on the device, with no sync).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r} "
            "(the GDN conv of Qwen3.5 takes its activation from config.hidden_act, silu in every "
            "published checkpoint; the conv backends fuse silu only: set hidden_act='silu')")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs one packed row (batch 1), got batch {x.shape[0]}")
    length, width = x.shape[1], weight.shape[1]
    dtype = compute_dtype(x.dtype)
    xs, w = x.to(dtype), weight.to(dtype)
    index = torch.arange(length, device=x.device)
    starts = (
        torch.zeros(1, dtype=torch.long, device=x.device)
        if cu_seqlens is None
        else cu_seqlens.to(device=x.device, dtype=torch.long)
    )
    owner = torch.searchsorted(starts, index, right=True) - 1  # the sequence of each row
    position = index - starts[owner]
    state = None if initial_state is None else _state_rows(initial_state, x, width, starts, dtype)
    out = xs * w[:, width - 1]
    for lag in range(1, width):
        shifted = F.pad(xs, (0, 0, lag, 0))[:, :length]
        # A select, not a product with 0: NaN * 0 is NaN, and would carry one sequence's NaN into the next.
        inside = (position >= lag).unsqueeze(-1)
        if state is None:
            before = torch.zeros((), dtype=dtype, device=x.device)
        else:  # the tap reads row (width - 1) - (lag - position) of the row's own sequence's state
            slot = (owner * (width - 1) + (width - 1) - lag + position).clamp(0, state.shape[0] - 1)
            before = state[slot]
        out = out + torch.where(inside, shifted, before) * w[:, width - 1 - lag]
    if bias is not None:
        out = out + bias.to(dtype)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def _state_rows(initial_state, x, width, starts, dtype):
    sequences = starts.shape[0] - 1 if starts.shape[0] > 1 else x.shape[0]
    expected = (sequences, width - 1, x.shape[-1])
    if x.shape[0] != 1 or tuple(initial_state.shape) != expected:
        raise ValueError(
            f"initial_state must be [sequences, W-1, D] = {list(expected)} over one packed row (batch 1), got "
            f"{list(initial_state.shape)} for x {list(x.shape)}: one state per sequence of cu_seqlens, its last "
            "W-1 input rows in time order"
        )
    return initial_state.to(dtype).reshape(-1, x.shape[-1])


class LookBack:
    """State kernels for `shared_prefix.conv.LookBackConv`: this reference, the state as rows `[N, W-1, D]`."""

    layout = "rows"
    # the plan's boundaries, read on the device with no sync, and nothing derived kept: a graph may capture it
    plan_tables = True

    def forward(self, x, weight, bias, state, idx, activation):
        return causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=idx.segment_cu, initial_state=state)

    def backward(self, x, weight, bias, state, dy, idx, activation):
        leaves = [t.detach().requires_grad_() for t in (x, weight, state)]
        b = None if bias is None else bias.detach().requires_grad_()
        with torch.enable_grad():
            y = LookBack.forward(self, *leaves[:2], b, leaves[2], idx, activation)
            grads = torch.autograd.grad(y, [*leaves, *([] if b is None else [b])], dy)
        dx, dweight, dstate = grads[:3]
        return dx, dweight, None if b is None else grads[3], dstate


causal_conv1d.look_back = LookBack()


class LookBackFromX(LookBack):
    """The same with layout "x" (our Triton kernels' protocol): `state` is `[S, W]` rows of x (slot 0
    unread, -1: zero), read here; the returned dx holds no state gradient, dstate is zero where no row."""

    layout = "x"

    def _state(self, x, rows):
        taps = rows[:, 1:]
        state = x[0].index_select(0, taps.clamp(min=0).reshape(-1)).view(*taps.shape, x.shape[-1])
        return torch.where((taps >= 0)[..., None], state, 0)

    def forward(self, x, weight, bias, state, idx, activation):
        return super().forward(x, weight, bias, self._state(x, state), idx, activation)

    def backward(self, x, weight, bias, state, dy, idx, activation):
        dx, dweight, dbias, dstate = super().backward(x, weight, bias, self._state(x, state), dy, idx, activation)
        return dx, dweight, dbias, torch.where((state[:, 1:] >= 0)[..., None], dstate, 0)
