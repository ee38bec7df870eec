"""Modules whose weights a fused op may read instead of calling them.

The fused SwiGLU MLP, the LM head's fused cross-entropy and the causal conv read a projection's
`.weight` and skip the module's forward. That is the module's own computation only when the module
is exactly torch's layer. A wrapper (PEFT's LoRA layers expose the base layer's weight as `.weight`,
so a fused op would train the base weight's copy and never the adapter) or a quantised subclass would
be skipped without a word: such modules are called instead (the conv is refused).

Forward hooks do not count: a hook on a projection inside a fused op does not fire, as in upstream's
kernel paths. Hooks are observers first (profilers, NaN hunts, `bench/bf16_departure.py`), and an
observer must not change the computation it observes.
"""

from __future__ import annotations

import torch

from ..errors import WrappedModuleUnsupported


def reads_as_weight(module, kind: type) -> bool:
    """True when calling `module` is exactly `kind`'s product with its `.weight` (no subclass or wrapper)."""
    return type(module) is kind


def plain_linears(*modules) -> bool:
    return all(reads_as_weight(m, torch.nn.Linear) for m in modules)


def conv_weight(conv) -> torch.Tensor:
    """The depthwise conv's `[channels, width]` weight for the causal-conv kernels, which never call the module.

    A wrapper or subclass (an adapter, quantisation) is refused: its computation would be skipped."""
    if not reads_as_weight(conv, torch.nn.Conv1d):
        raise WrappedModuleUnsupported(
            f"the gated delta net's conv1d is a {type(conv).__module__}.{type(conv).__qualname__}, not a plain "
            "torch.nn.Conv1d: the causal conv kernels read its weight and never call it, so an adapter or "
            "quantisation on it would be skipped. Leave 'conv1d' out of the adapter's target_modules (PEFT) "
            "and of quantisation"
        )
    return conv.weight.squeeze(1)
