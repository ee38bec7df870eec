"""Resolution of every op slot to one backend: explicit choices first, then the device's preferences.

Order, per slot (first that applies wins; docs/kernel_selection.md):
1. the config's ``ops_implementation.<slot>`` when not ``auto``; for ``moe_experts``, else
   transformers' ``experts_implementation`` (``experts_implementation_choice``);
2. the environment variable ``PATCHGEN_OPS_<SLOT>`` when set and not ``auto``;
3. ``defaults[slot]`` (the generated module's device config) when given and not ``auto``: a
   preference, used when available with every required capability, else step 4 (the table says why:
   a GPU module built on a CPU machine still runs);
4. ``auto``: the first available backend, in the device target's preference order, that has every
   required capability.
An explicit choice (1-2) that is unavailable or lacks a required capability raises
BackendUnavailable; it never silently falls back.

Dtype: a slot is resolved at build time for the dtypes its backend computes in. A model can be cast
afterwards (``.double()``, ``.to(torch.bfloat16)``), and autocast changes what an op sees, so the
table reads the dtype of each call's first tensor: a dtype the chosen backend cannot compute in is
resolved once more, by the same order, and cached per (slot, dtype). An explicit choice that cannot
compute in that dtype raises; a device default or ``auto`` moves to the first backend that can.

Per-call capabilities: some capabilities are asked for by a call, not by the model (the per-token
entropy of ``cross_entropy``, which RL trainers ask for on some passes only). ``table.serving(slot,
capability)`` is the function for such calls: the bound backend when it has the capability, else,
for a device default or ``auto``, the first backend of the same order that has it (resolved once,
cached, shown by ``describe()``); an explicit choice without it raises.
"""

from __future__ import annotations

import difflib
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import registry
from .config import AUTO, ENV_DEVICE_TARGET, OpsImplementationConfig, check_environment, env_var, from_env
from .errors import BackendUnavailable
from .handles import KernelHandle, dtype_name
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
        # ours before fla's: fla tunes its gated norm per bucket of row count, and its configurations round
        # some rows differently, so a shared pass (C rows) and packed (T) could differ by the tunings' luck;
        # ours has one launch shape for every row count and is no slower (docs/kernel_selection.md)
        "rms_norm_gated": ("triton", "fla", "torch"),
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
        "cross_entropy": ("liger", "triton", "chunked", "eager"),
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
        fix = "pass one of those" if explicit else f"set {ENV_DEVICE_TARGET} to one of those or unset it to detect the device"
        where = "the explicit argument" if explicit else f"environment variable {ENV_DEVICE_TARGET}"
        raise ValueError(f"device target must be one of {DEVICE_TARGETS} (gpu for CUDA), got {target!r} from {where}: {fix}")
    return target


def _detect() -> str:
    import torch

    if torch.cuda.is_available():
        return "gpu"
    return "npu" if registry.npu_available() else "cpu"


@dataclass(frozen=True)
class Choice:
    """The backend resolved for one slot, and why it was chosen.

    ``explicit``: asked for by name (config or environment), so never replaced by another backend.
    """

    slot: str
    handle: KernelHandle
    why: str
    explicit: bool = False

    @property
    def backend(self) -> str:
        return self.handle.name


class OpTable:
    """The resolved op slots of one model: ``table.<slot>(...)`` calls the chosen backend.

    Immutable once built; copying returns the same table and pickling re-resolves by backend name.
    A slot whose backend computes in every floating dtype is the backend's function itself; any
    other slot is a ``DtypeDispatch`` that reads the call's dtype (see the module docstring).
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

    def __init__(
        self,
        choices: Mapping[str, Choice],
        device_target: str,
        require: Mapping[str, frozenset[str]] | None = None,
    ):
        object.__setattr__(self, "choices", dict(choices))
        object.__setattr__(self, "device_target", device_target)
        object.__setattr__(self, "require", {slot: frozenset(caps) for slot, caps in (require or {}).items()})
        object.__setattr__(self, "by_dtype", {})  # (slot, dtype name, extra caps) -> Choice, resolved again
        object.__setattr__(self, "by_capability", {})  # (slot, capability) -> (Choice, callable)
        object.__setattr__(self, "_lock", threading.Lock())
        # what a captured graph of a layer depends on (`modeling/scoring_layers.py`): equal for tables that run the
        # same kernels (a reference model's table, resolved apart from the policy's)
        object.__setattr__(self, "backends_key", (
            device_target,
            tuple((slot, choice.handle) for slot, choice in sorted(self.choices.items())),
            tuple(sorted(self.require.items())),
        ))
        for slot, choice in choices.items():
            fn = choice.handle.load()
            if not FLOATING <= choice.handle.dtypes:
                fn = DtypeDispatch(self, slot, fn)
            object.__setattr__(self, slot, fn)

    def __setattr__(self, name, value):
        raise AttributeError("an OpTable is immutable; resolve a new one")

    def handle(self, slot: str) -> KernelHandle:
        return self.choices[slot].handle

    def backend(self, slot: str) -> str:
        return self.choices[slot].backend

    def choice_for(self, slot: str, dtype, extra: frozenset[str] = frozenset()) -> Choice:
        """The backend that runs ``slot`` for inputs of ``dtype`` (resolved on first ask, then cached);
        ``extra``: capabilities the call asks for beyond the model's (see ``serving``)."""
        primary = self._capable(slot, extra)
        if primary.handle.serves(dtype):
            return primary
        key = (slot, dtype_name(dtype), extra)
        found = self.by_dtype.get(key)
        if found is None:
            with self._lock:
                needed = self.require.get(slot, frozenset()) | extra
                found = self.by_dtype.get(key) or _for_dtype(primary, key[1], self.device_target, needed)
                self.by_dtype[key] = found
        return found

    def serving(self, slot: str, capability: str) -> Callable:
        """The function for calls of ``slot`` that need ``capability`` (one dict lookup once resolved)."""
        found = self.by_capability.get((slot, capability))
        if found is None:
            with self._lock:
                found = self.by_capability.get((slot, capability)) or self._resolve_capability(slot, capability)
                self.by_capability[(slot, capability)] = found
        return found[1]

    def serving_choice(self, slot: str, capability: str) -> Choice:
        """The backend `serving(slot, capability)` calls (resolved on first ask, as there)."""
        self.serving(slot, capability)
        return self.by_capability[(slot, capability)][0]

    def _capable(self, slot: str, extra: frozenset[str]) -> Choice:
        primary = self.choices[slot]
        for capability in sorted(extra - primary.handle.capabilities):
            self.serving(slot, capability)
            primary = self.by_capability[(slot, capability)][0]
        return primary

    def _resolve_capability(self, slot: str, capability: str) -> tuple[Choice, Callable]:
        primary = self.choices[slot]
        if capability in primary.handle.capabilities:
            return primary, getattr(self, slot)
        needed = self.require.get(slot, frozenset()) | {capability}
        lacks = f"lacks {capability!r}, which this call asks for"
        if primary.explicit:
            raise BackendUnavailable(slot, primary.backend, lacks, working(slot, needed))
        fallback = _auto(slot, self.device_target, needed)
        choice = Choice(slot, fallback.handle, f"{primary.backend!r} {lacks}; {fallback.why}")
        fn = choice.handle.load()
        if not FLOATING <= choice.handle.dtypes:
            fn = DtypeDispatch(self, slot, fn, frozenset({capability}), choice.handle)
        return choice, fn

    def describe(self) -> str:
        """A printable table: slot, backend, why (and any slot resolved again for another dtype)."""
        choices = list(self.choices.values()) + [
            Choice(f"{slot} [{capability}]", c.handle, c.why)
            for (slot, capability), (c, _) in sorted(self.by_capability.items(), key=lambda item: item[0])
            if c is not self.choices[slot]
        ] + [
            Choice(f"{slot} [{', '.join([dtype, *sorted(extra)])}]", c.handle, c.why)
            for (slot, dtype, extra), c in sorted(self.by_dtype.items(), key=lambda item: item[0][:2])
        ]
        rows = [("slot", "backend", "why")] + [(c.slot, c.backend, c.why) for c in choices]
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
        names = {slot: (c.backend, c.why, c.explicit) for slot, c in self.choices.items()}
        return _rebuild, (names, self.device_target, self.require)


FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})


class DtypeDispatch:
    """One slot of an OpTable whose backend does not compute in every dtype.

    Calls go to the function cached for the first argument's dtype: one dict lookup, no resolution
    after the first call in a dtype.
    """

    __slots__ = ("by_dtype", "extra", "slot", "table")

    def __init__(self, table: OpTable, slot: str, fn: Callable, extra=frozenset(), handle: KernelHandle | None = None):
        import torch

        self.table, self.slot, self.extra = table, slot, extra
        handle = handle or table.choices[slot].handle
        self.by_dtype = {d: fn for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64) if handle.serves(d)}

    def __call__(self, x, *args, **kwargs):
        return self.function_for(x.dtype)(x, *args, **kwargs)

    def function_for(self, dtype) -> Callable:
        """The backend function that calls in ``dtype`` run (resolved on first ask, then cached); callers
        that read a backend's extra stages (`rounds`, `look_back`) ask here before any call is made."""
        fn = self.by_dtype.get(dtype)
        if fn is None:
            fn = self.table.choice_for(self.slot, dtype, self.extra).handle.load()
            self.by_dtype[dtype] = fn
        return fn

    def __repr__(self) -> str:
        return f"DtypeDispatch({self.slot}: {self.table.backend(self.slot)})"


def _for_dtype(primary: Choice, dtype: str, target: str, needed: frozenset[str]) -> Choice:
    slot, name = primary.slot, primary.backend
    cannot = f"cannot compute in {dtype} (it computes in {', '.join(sorted(primary.handle.dtypes))})"
    if primary.explicit:
        raise BackendUnavailable(slot, name, cannot, working(slot, needed, dtype))
    fallback = _auto(slot, target, needed, dtype)
    return Choice(slot, fallback.handle, f"{name!r} {cannot}; {fallback.why}")


def _rebuild(names: dict[str, tuple[str, str, bool]], target: str, require: Mapping[str, frozenset[str]]) -> OpTable:
    choices = {
        slot: Choice(slot, _usable(slot, name, require.get(slot, frozenset())), why, explicit)
        for slot, (name, why, explicit) in names.items()
    }
    return OpTable(choices, target, require)


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
    check_environment()
    target = resolve_device_target(device_target)
    require = dict(require or {})
    unknown = (set(require) | set(defaults or {})) - set(SLOTS)
    if unknown:
        raise ValueError(f"unknown op slots {sorted(unknown)}; slots are {list(SLOTS)}")
    choices = {}
    for slot in SLOTS:
        needed = frozenset(require.get(slot, ()))
        explicit = experts_implementation_choice(config, asked) if slot == "moe_experts" else _explicit(slot, asked)
        if explicit is None:
            choices[slot] = _preferred(slot, (defaults or {}).get(slot, AUTO), target, needed)
        else:
            name, why = explicit
            choices[slot] = Choice(slot, _usable(slot, name, needed), why, explicit=True)
    return OpTable(choices, target, {slot: frozenset(caps) for slot, caps in require.items()})


def _explicit(slot, asked) -> tuple[str, str] | None:
    field = getattr(asked, slot)
    if field != AUTO:
        return field, f"config ops_implementation.{slot}={field!r}"
    env = from_env(slot)
    if env is not None:
        return env, f"env {env_var(slot)}={env}"
    return None


# transformers' `experts_implementation` names -> the moe_experts backend computing the same thing.
EXPERTS_IMPLEMENTATIONS = {"eager": "eager", "grouped_mm": "grouped_mm", "batched_mm": "batched_mm"}


def experts_implementation_choice(config: Any, asked: OpsImplementationConfig) -> tuple[str, str] | None:
    """The explicit moe_experts choice: ``ops_implementation.moe_experts``, else transformers'
    ``config._experts_implementation`` (``from_pretrained(experts_implementation=...)``,
    ``set_experts_implementation``), else the environment; two config choices that disagree raise.
    A config without experts (``num_experts``) has no experts request: transformers fills in ``eager``."""
    holders = [h for h in (config, getattr(config, "text_config", None)) if h is not None]
    requested = None
    if any(getattr(h, "num_experts", None) for h in holders):
        for holder in holders:
            requested = requested or getattr(holder, "_experts_implementation_internal", None)
    if requested is None:
        return _explicit("moe_experts", asked)
    backend = EXPERTS_IMPLEMENTATIONS.get(requested)
    if backend is None:
        supported = ", ".join(sorted(EXPERTS_IMPLEMENTATIONS))
        raise BackendUnavailable(
            "moe_experts",
            requested,
            f"experts_implementation={requested!r} has no moe_experts backend (supported: {supported}); ask for one "
            "of those, or name a backend in ops_implementation.moe_experts",
            working("moe_experts"),
        )
    _refuse_replaced_transformers_experts_function(requested)
    if asked.moe_experts not in (AUTO, backend):
        raise ValueError(
            f"moe_experts asked twice: ops_implementation.moe_experts={asked.moe_experts!r} and "
            f"experts_implementation={requested!r} (backend {backend!r}); set only one of them"
        )
    if asked.moe_experts != AUTO:
        return asked.moe_experts, f"config ops_implementation.moe_experts={asked.moe_experts!r}"
    return backend, f"config experts_implementation={requested!r}"


# The function transformers registers under each name in `ALL_EXPERTS_FUNCTIONS` (eager has none).
_TRANSFORMERS_EXPERTS_FUNCTIONS = {
    "grouped_mm": "grouped_mm_experts_forward",
    "batched_mm": "batched_mm_experts_forward",
}


def _refuse_replaced_transformers_experts_function(requested: str) -> None:
    """Upstream dispatches ``experts_implementation`` through ``ALL_EXPERTS_FUNCTIONS``; the generated
    experts run the moe_experts backend of the same name instead. Where that registry entry was replaced
    (a custom kernel registered under ``grouped_mm``, a patched mapping), upstream would call the
    replacement: refuse rather than silently compute something else."""
    if requested not in _TRANSFORMERS_EXPERTS_FUNCTIONS:
        return
    from transformers.integrations import moe

    registered = moe.ALL_EXPERTS_FUNCTIONS.get(requested)
    own = getattr(moe, _TRANSFORMERS_EXPERTS_FUNCTIONS[requested])
    if registered is not own:
        raise BackendUnavailable(
            "moe_experts",
            requested,
            f"transformers' ALL_EXPERTS_FUNCTIONS[{requested!r}] is {registered!r}, not transformers' own "
            f"{own.__name__}; the generated experts run patchgen's moe_experts backend {requested!r} and would "
            "not call it. Restore the registry entry, or add the kernel as a patchgen moe_experts backend "
            "(docs/kernel_selection.md)",
            working("moe_experts"),
        )


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


def working(slot: str, needed: frozenset[str] = frozenset(), dtype: str | None = None) -> list[str]:
    """Backends of ``slot`` that are available here, have every capability in ``needed`` and
    (when given) compute in ``dtype``."""
    return [
        h.name
        for h in registry.BACKENDS[slot]
        if not h.missing(needed) and (dtype is None or h.serves(dtype)) and h.available
    ]


def _usable(slot: str, name: str, needed: frozenset[str]) -> KernelHandle:
    handle = registry.handle(slot, name)
    if handle is None:
        names = [h.name for h in registry.BACKENDS[slot]]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        reason = f"no such backend (known: {', '.join(names)}){hint}"
        raise BackendUnavailable(slot, name, reason, working(slot, needed))
    lacking = handle.missing(needed)
    if lacking:
        reason = f"lacks required capabilities {sorted(lacking)}"
        raise BackendUnavailable(slot, name, reason, working(slot, needed))
    if not handle.available:
        raise BackendUnavailable(slot, name, handle.reason, working(slot, needed))
    return handle


def _auto(slot: str, target: str, needed: frozenset[str], dtype: str | None = None) -> Choice:
    skipped = []
    for name in AUTO_ORDER[target][slot]:
        handle = registry.handle(slot, name)
        lacking = handle.missing(needed)
        if lacking:
            skipped.append(f"{name}: lacks {sorted(lacking)}")
        elif dtype is not None and not handle.serves(dtype):
            skipped.append(f"{name}: not in {dtype}")
        elif not handle.available:
            skipped.append(f"{name}: {handle.reason}")
        else:
            why = f"auto ({target})" + (f"; skipped {'; '.join(skipped)}" if skipped else "")
            return Choice(slot, handle, why)
    for_dtype = f" for {dtype}" if dtype else ""
    reason = f"no backend in the {target} order {list(AUTO_ORDER[target][slot])} works{for_dtype}: {'; '.join(skipped)}"
    raise BackendUnavailable(slot, AUTO, reason, working(slot, needed, dtype))
