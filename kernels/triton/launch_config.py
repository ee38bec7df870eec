"""Launch configurations of our Triton kernels: named presets, chosen per call by argument, per
process by an environment variable, per device model by the tuning table (tuning_table.json beside
this file, which `bench/triton_tuning.py --sweep` then `--write-table` fill), else the code's default."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from ..errors import SettingError


def parse_config(text: str, presets: dict, what: str, env: str | None = None):
    """`preset` or `preset,field=value,...` (or `field=value,...` over the first preset) -> a config.
    `env` names where the text came from (an environment variable, or a tuning-table entry) for errors.

    Values are read as int, None, True, False, or else kept as text; fields are checked against the
    dataclass."""
    where = repr(text) if not env else f"{env}={text!r}" if env.isidentifier() else f"{env}: {text!r}"
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


# Per device model, the measured best preset of each kernel (written by
# `bench/triton_tuning.py --write-table`, read here); a model not in it gets the code's default.
TABLE_PATH = os.path.join(os.path.dirname(__file__), "tuning_table.json")
_TABLE: dict | None = None
_DEVICE_MODELS: dict = {}
_RESOLVED: dict = {}


def _table() -> dict:
    global _TABLE
    if _TABLE is None:
        try:
            with open(TABLE_PATH) as fh:
                _TABLE = json.load(fh)
        except FileNotFoundError:
            _TABLE = {}
        except json.JSONDecodeError as exc:
            raise SettingError(f"{TABLE_PATH}: not valid JSON ({exc}); restore it from git or rewrite it with "
                               f"bench/triton_tuning.py --write-table") from exc
    return _TABLE


def device_model(device) -> str:
    """The key a device has in the tuning table: a CUDA device's name (`NVIDIA H200`), else its type."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_MODELS:
        _DEVICE_MODELS[index] = torch.cuda.get_device_name(index)
    return _DEVICE_MODELS[index]


def table_config(kernel: str, presets: dict, fallback, device, what: str):
    """The launch configuration the tuning table gives `kernel` on `device`'s model, or `fallback`.

    An entry is a preset spec as the environment variables take it (`window`, `window,bwd_rows=8`);
    one that names no preset or field is refused, naming the table. Resolved once per kernel and device."""
    key = (kernel, device)
    got = _RESOLVED.get(key)
    if got is None:
        model = device_model(device)
        spec = _table().get(model, {}).get(kernel)
        where = f"{TABLE_PATH} [{model!r}][{kernel!r}]"
        got = _RESOLVED[key] = fallback if spec is None else parse_config(spec, presets, what, where)
    return got


def _reset_table() -> None:
    """Forget the table and what was resolved from it (tests, and a table rewritten in-process)."""
    global _TABLE
    _TABLE = None
    _RESOLVED.clear()
