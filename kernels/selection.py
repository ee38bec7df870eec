"""Resolution of every op slot to one backend: explicit choices first, then the device's preferences.

Order, per slot (first that applies wins; docs/kernel_selection.md):
1. the config's ``ops_implementation.<slot>`` when not ``auto``;
2. the environment variable ``PATCHGEN_OPS_<SLOT>`` when set and not ``auto``;
3. ``defaults[slot]`` (the generated module's device config) when given and not ``auto``: a
   preference, used when available with every required capability, else step 4 (the table says why:
   a GPU module built on a CPU machine still runs);
4. ``auto``: the first available backend, in the device target's preference order, that has every
   required capability.
An explicit choice (1-2) that is unavailable or lacks a required capability raises
BackendUnavailable; it never silently falls back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import registry
from .config import AUTO, ENV_DEVICE_TARGET, OpsImplementationConfig, env_var, from_env
from .errors import BackendUnavailable
from .handles import KernelHandle
from .registry import SLOTS

DEVICE_TARGETS = ("gpu", "npu", "cpu")

_PORTABLE = {
    "rms_norm": ("torch",),
    "rotary": ("torch",),
    "swiglu_mlp": ("torch",),
    "attention": ("sdpa", "eager"),
    "cross_entropy": ("chunked", "eager"),
    "moe_experts": ("eager",),
}
# What ``auto`` tries, in order, per device target.
AUTO_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "gpu": {
        "gated_delta_rule": ("fla", "triton", "torch"),
        "causal_conv1d": ("fla", "triton", "torch"),
        "rms_norm_gated": ("fla", "triton", "torch"),
        "rms_norm": ("liger", "torch"),
        "rotary": ("liger", "torch"),
        "swiglu_mlp": ("liger", "torch"),
        "attention": (
            "flash_attention_3",
            "flash_attention_2",
            "flash_attention_4",
            "torch_varlen",
            "sdpa",
            "eager",
        ),
        "cross_entropy": ("liger", "chunked", "eager"),
        "moe_experts": ("grouped_mm", "eager"),
    },
    "npu": {
        "gated_delta_rule": ("triton", "torch"),
        "causal_conv1d": ("triton", "torch"),
        "rms_norm_gated": ("triton", "torch"),
        **_PORTABLE,
        # torch_npu's fused operators first (kernels/backends/npu_*.py).
        "rms_norm": ("npu_rms_norm", "torch"),
        "rotary": ("npu_rotary_mul", "torch"),
        "swiglu_mlp": ("npu_swiglu", "torch"),
        "attention": ("npu_fusion_attention", "sdpa", "eager"),
        "moe_experts": ("npu_grouped_matmul", "eager"),
    },
    "cpu": {
        "gated_delta_rule": ("torch",),
        "causal_conv1d": ("torch",),
        "rms_norm_gated": ("torch",),
        **_PORTABLE,
    },
}


def resolve_device_target(explicit: str | None = None) -> str:
    """The device target: ``explicit``, else ``PATCHGEN_DEVICE_TARGET``, else detected (CUDA, NPU, CPU)."""
    target = explicit or os.environ.get(ENV_DEVICE_TARGET, "").strip() or _detect()
    if target not in DEVICE_TARGETS:
        raise ValueError(f"device target must be one of {DEVICE_TARGETS}, got {target!r}")
    return target


def _detect() -> str:
    import torch

    if torch.cuda.is_available():
        return "gpu"
    return "npu" if registry.npu_available() else "cpu"


@dataclass(frozen=True)
class Choice:
    """The backend resolved for one slot, and why it was chosen."""

    slot: str
    handle: KernelHandle
    why: str

    @property
    def backend(self) -> str:
        return self.handle.name


class OpTable:
    """The resolved op slots of one model: ``table.<slot>(...)`` calls the chosen backend.

    Immutable once built; copying returns the same table and pickling re-resolves by backend name.
    """

    gated_delta_rule: Callable
    causal_conv1d: Callable
    rms_norm_gated: Callable
    rms_norm: Callable
    rotary: Callable
    swiglu_mlp: Callable
    attention: Callable
    cross_entropy: Callable
    moe_experts: Callable

    def __init__(self, choices: Mapping[str, Choice], device_target: str):
        object.__setattr__(self, "choices", dict(choices))
        object.__setattr__(self, "device_target", device_target)
        for slot, choice in choices.items():
            object.__setattr__(self, slot, choice.handle.load())

    def __setattr__(self, name, value):
        raise AttributeError("an OpTable is immutable; resolve a new one")

    def handle(self, slot: str) -> KernelHandle:
        return self.choices[slot].handle

    def backend(self, slot: str) -> str:
        return self.choices[slot].backend

    def describe(self) -> str:
        """A printable table: slot, backend, why."""
        rows = [("slot", "backend", "why")] + [(c.slot, c.backend, c.why) for c in self.choices.values()]
        widths = [max(len(row[i]) for row in rows) for i in range(2)]
        lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]
        lines.insert(1, f"{'-' * widths[0]}  {'-' * widths[1]}  ---")
        return f"op slots (device target {self.device_target}):\n" + "\n".join(lines)

    def __repr__(self) -> str:
        picks = ", ".join(f"{slot}={c.backend}" for slot, c in self.choices.items())
        return f"OpTable({self.device_target}: {picks})"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        names = {slot: c.backend for slot, c in self.choices.items()}
        return _rebuild, (names, self.device_target)


def _rebuild(names: dict[str, str], target: str) -> OpTable:
    return resolve(OpsImplementationConfig(**names), device_target=target)


def resolve(
    config: Any = None,
    device_target: str | None = None,
    require: Mapping[str, set[str] | frozenset[str]] | None = None,
    defaults: Mapping[str, str] | None = None,
) -> OpTable:
    """Resolve every op slot once (see the module docstring for the order) into an OpTable.

    ``config`` is anything ``OpsImplementationConfig.from_any`` reads; ``require`` maps a slot to the
    capabilities it must have (``{"gated_delta_rule": {"varlen", "initial_state_grad"}}``).
    """
    asked = OpsImplementationConfig.from_any(config)
    target = resolve_device_target(device_target)
    require = dict(require or {})
    unknown = (set(require) | set(defaults or {})) - set(SLOTS)
    if unknown:
        raise ValueError(f"unknown op slots {sorted(unknown)}; slots are {list(SLOTS)}")
    choices = {}
    for slot in SLOTS:
        needed = frozenset(require.get(slot, ()))
        explicit = _explicit(slot, asked)
        if explicit is None:
            choices[slot] = _preferred(slot, (defaults or {}).get(slot, AUTO), target, needed)
        else:
            name, why = explicit
            choices[slot] = Choice(slot, _usable(slot, name, needed), why)
    return OpTable(choices, target)


def _explicit(slot, asked) -> tuple[str, str] | None:
    field = getattr(asked, slot)
    if field != AUTO:
        return field, f"config ops_implementation.{slot}={field!r}"
    env = from_env(slot)
    if env is not None:
        return env, f"env {env_var(slot)}={env}"
    return None


def _preferred(slot: str, default: str, target: str, needed: frozenset[str]) -> Choice:
    """The device default when it can serve here, else auto with the reason it could not."""
    if default == AUTO:
        return _auto(slot, target, needed)
    handle = registry.handle(slot, default)
    if handle is None:
        known = ", ".join(h.name for h in registry.BACKENDS[slot])
        raise ValueError(f"device default {slot}={default!r} names no backend (known: {known})")
    lacking = handle.missing(needed)
    if not lacking and handle.available:
        return Choice(slot, handle, f"device default ({target}) {slot}={default!r}")
    reason = f"lacks {sorted(lacking)}" if lacking else handle.reason
    fallback = _auto(slot, target, needed)
    return Choice(slot, fallback.handle, f"device default {default!r} unusable here ({reason}); {fallback.why}")


def working(slot: str, needed: frozenset[str] = frozenset()) -> list[str]:
    """Backends of ``slot`` that are available here and have every capability in ``needed``."""
    return [h.name for h in registry.BACKENDS[slot] if not h.missing(needed) and h.available]


def _usable(slot: str, name: str, needed: frozenset[str]) -> KernelHandle:
    handle = registry.handle(slot, name)
    if handle is None:
        known = ", ".join(h.name for h in registry.BACKENDS[slot])
        raise BackendUnavailable(slot, name, f"no such backend (known: {known})", working(slot, needed))
    lacking = handle.missing(needed)
    if lacking:
        reason = f"lacks required capabilities {sorted(lacking)}"
        raise BackendUnavailable(slot, name, reason, working(slot, needed))
    if not handle.available:
        raise BackendUnavailable(slot, name, handle.reason, working(slot, needed))
    return handle


def _auto(slot: str, target: str, needed: frozenset[str]) -> Choice:
    skipped = []
    for name in AUTO_ORDER[target][slot]:
        handle = registry.handle(slot, name)
        lacking = handle.missing(needed)
        if lacking:
            skipped.append(f"{name}: lacks {sorted(lacking)}")
        elif not handle.available:
            skipped.append(f"{name}: {handle.reason}")
        else:
            why = f"auto ({target})" + (f"; skipped {'; '.join(skipped)}" if skipped else "")
            return Choice(slot, handle, why)
    reason = f"no backend in the {target} order {list(AUTO_ORDER[target][slot])} works: {'; '.join(skipped)}"
    raise BackendUnavailable(slot, AUTO, reason, working(slot, needed))
