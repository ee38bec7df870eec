"""Launch configurations of our Triton kernels: named presets, chosen per process by an environment
variable or per call by argument (bench/triton_tuning.py --sweep times every preset)."""

from __future__ import annotations

import dataclasses
import os

from ..errors import SettingError


def parse_config(text: str, presets: dict, what: str, env: str | None = None):
    """`preset` or `preset,field=value,...` (or `field=value,...` over the first preset) -> a config.

    Values are read as int, None, True, False, or else kept as text; fields are checked against the
    dataclass."""
    where = f"{env}={text!r}" if env else repr(text)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    name = parts[0] if parts and "=" not in parts[0] else None
    if name is not None and name not in presets:
        raise SettingError(f"{where}: unknown {what} preset {name!r}; known: {', '.join(presets)}; "
                                f"or give fields as field=value")
    base = presets[name] if name is not None else next(iter(presets.values()))
    fields = {f.name for f in dataclasses.fields(base)}
    changes = {}
    for part in parts[1 if name is not None else 0:]:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise SettingError(f"{where}: {part!r} is not field=value with a field of {type(base).__name__} "
                                    f"({', '.join(sorted(fields))})")
        value = value.strip()
        changes[key] = {"None": None, "True": True, "False": False}.get(value, int(value) if value.lstrip("-").isdigit()
                                                                         else value)
    return dataclasses.replace(base, **changes)


def config_from_env(env: str, presets: dict, default, what: str):
    """The config the environment variable `env` names, or `default` when it is unset or empty."""
    text = os.environ.get(env, "")
    return parse_config(text, presets, what, env) if text.strip() else default
