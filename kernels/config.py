"""What the user asked for, per op slot: the model config's ``ops_implementation`` and the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .registry import SLOTS

AUTO = "auto"
ENV_PREFIX = "PATCHGEN_OPS_"
ENV_DEVICE_TARGET = "PATCHGEN_DEVICE_TARGET"


@dataclass
class OpsImplementationConfig:
    """One backend name per op slot; ``"auto"`` leaves the choice to the environment and the device."""

    gated_delta_rule: str = AUTO
    causal_conv1d: str = AUTO
    rms_norm_gated: str = AUTO
    rms_norm: str = AUTO
    rotary: str = AUTO
    swiglu_mlp: str = AUTO
    attention: str = AUTO
    cross_entropy: str = AUTO
    moe_experts: str = AUTO

    @classmethod
    def from_any(cls, source: Any) -> OpsImplementationConfig:
        """From None, this dataclass, a dict of slot -> backend, or a model config (``ops_implementation``,
        also under ``text_config``). Unknown slot names are an error, not silently ignored."""
        if source is None or isinstance(source, cls):
            return source or cls()
        if isinstance(source, Mapping):
            unknown = set(source) - set(SLOTS)
            if unknown:
                raise ValueError(
                    f"ops_implementation names unknown op slots {sorted(unknown)}; slots are {list(SLOTS)}"
                )
            return cls(**{slot: str(name) for slot, name in source.items()})
        for holder in (source, getattr(source, "text_config", None)):
            value = getattr(holder, "ops_implementation", None) if holder is not None else None
            if value is not None:
                return cls.from_any(value)
        if hasattr(source, "to_dict") or hasattr(source, "model_type"):
            return cls()  # a model config that asks for nothing
        raise TypeError(f"cannot read ops_implementation from {type(source).__name__}")


def env_var(slot: str) -> str:
    """``PATCHGEN_OPS_<SLOT>``, e.g. ``PATCHGEN_OPS_GATED_DELTA_RULE``."""
    return ENV_PREFIX + slot.upper()


def from_env(slot: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The backend the environment asks for, or None when unset, empty or ``auto``."""
    value = (os.environ if environ is None else environ).get(env_var(slot), "").strip()
    return value if value and value != AUTO else None
