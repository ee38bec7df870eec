"""The cost a deeper prefix tree is charged per level: a figure measured per device, never timed at run time.

One more level saves rows of token-wise work but adds a GDN round to every linear-attention layer
(its launches, gathers and host time): a fixed cost, whatever the rows. `bench/level_cost.py`
measures it on a device in rows of compact-row work and records it, with how it was measured, in
`level_costs.json` beside this module; `build_plan` reads the figure of the device its batch is
on. Nothing is timed while training, so every rank of a distributed job (same device kind, same
patchgen) builds the same plan from the same batch, run after run.

Where the figure comes from, first match wins: the `shared_prefix_level_cost` config field (a
whole number), the environment variable `PATCHGEN_SHARED_PREFIX_LEVEL_COST`, the table's entry for
the device's name, and for a device nobody measured `LEVEL_COST_TOKENS` (an estimate).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SettingError

ENV_LEVEL_COST = "PATCHGEN_SHARED_PREFIX_LEVEL_COST"
AUTO = "auto"
LEVEL_COST_TOKENS = 256  # the estimate for a device without a measurement (rows per level)
TABLE = Path(__file__).with_name("level_costs.json")
ROWS_KEY = "level_cost_rows"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LevelCost:
    """Rows one more level must save to be used, and where that figure came from."""

    rows: int
    source: str  # "config", the environment variable, "measured (...)" or "estimate (...)"


def parse_level_cost(value, where: str, *, text: bool = False) -> int | None:
    """A whole number of rows >= 0, or None for `auto` / None (the device's measured figure).

    `where` names the setting as the user wrote it (`config field shared_prefix_level_cost`,
    `PATCHGEN_SHARED_PREFIX_LEVEL_COST='abc'`), for the error message; `text`: the value is an
    environment variable's, where a number is written as digits (and empty means unset).
    """
    if value is None:
        return None
    if isinstance(value, str):
        stripped = value.strip()
        if stripped == AUTO or (text and not stripped):
            return None
        if text and stripped.isdigit():
            return int(stripped)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise SettingError(
        f"{where} must be a whole number of rows >= 0 (what one more level of the prefix tree must "
        f"save to be used) or 'auto' (the figure measured for the device, see bench/level_cost.py), "
        f"got {value!r}: set e.g. 256, or 'auto'"
    )


def device_name(device: torch.device | str) -> str:
    """The key of a device in the table: `cpu`, or the accelerator's name (`NVIDIA H200`)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    return _accelerator_name(device.type, device.index)


@functools.cache
def _accelerator_name(kind: str, index: int | None) -> str:
    module = getattr(torch, kind, None)
    name = getattr(module, "get_device_name", None)
    if name is None:
        return kind
    return str(name() if index is None else name(index))


@functools.cache
def measured(path: Path = TABLE) -> Mapping[str, Mapping]:
    """The table: device name -> its entry (`level_cost_rows` and how it was measured)."""
    table = json.loads(Path(path).read_text())
    devices = table.get("devices")
    if not isinstance(devices, dict):
        raise TypeError(f"{path}: no 'devices' object; rewrite it with bench/level_cost.py --write")
    for name, entry in devices.items():
        rows = entry.get(ROWS_KEY) if isinstance(entry, dict) else None
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(
                f"{path}: device {name!r} has {ROWS_KEY}={rows!r}, not a whole number >= 0; "
                f"measure it again with bench/level_cost.py --write"
            )
    return devices


def resolve_level_cost(
    device: torch.device | str, configured=None, environ: Mapping[str, str] | None = None
) -> LevelCost:
    """The per-level cost for a plan on `device`: `configured` (an int, or None / 'auto'), else the
    environment, else the device's measured figure, else the estimate."""
    rows = parse_level_cost(configured, "config field shared_prefix_level_cost")
    if rows is not None:
        return LevelCost(rows, "config")
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_LEVEL_COST)
    rows = parse_level_cost(text, f"{ENV_LEVEL_COST}={text!r}", text=True)
    if rows is not None:
        return LevelCost(rows, ENV_LEVEL_COST)
    name = device_name(device)
    entry = measured().get(name)
    if entry is not None:
        return LevelCost(entry[ROWS_KEY], f"measured ({name}, {entry.get('date', 'undated')})")
    _note_estimate(name)
    return LevelCost(LEVEL_COST_TOKENS, f"estimate (no measurement for {name})")


@functools.cache
def _note_estimate(name: str) -> None:
    logger.info(
        "shared-prefix trees on %s charge %d rows per level, an estimate: no measurement for this device "
        "(run bench/level_cost.py --write on it, or set shared_prefix_level_cost)",
        name,
        LEVEL_COST_TOKENS,
    )
