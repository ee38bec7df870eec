"""What generated forwards use: ``bind`` a model's op table once at build time, read it with ``of``.

table = ops.bind(model, model.config)        # model build: resolve once, store on submodules
o, state = ops.of(self).gated_delta_rule(...) # forward: no resolution, one attribute read
print(ops.describe(model))                    # inspection: reads the bound table, changes nothing
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from .config import OpsImplementationConfig, check_model_config, store_ops_implementation_as_dict
from .selection import OpTable, resolve

__all__ = [
    "OpTable",
    "OpsImplementationConfig",
    "bind",
    "default_table",
    "describe",
    "is_bound",
    "of",
    "reset_default",
    "resolve",
]

ATTRIBUTE = "_patchgen_ops"

_default: OpTable | None = None
_default_lock = threading.Lock()


def bind(
    model,
    config: Any = None,
    device_target: str | None = None,
    *,
    require: Mapping[str, set[str] | frozenset[str]] | None = None,
    defaults: Mapping[str, str] | None = None,
) -> OpTable:
    """Resolve the op slots once and store the table on ``model`` and every submodule.

    ``config`` defaults to ``model.config``. The table is a plain attribute: not a parameter or
    buffer, not in the state dict. Returns the table (print ``table.describe()`` to see it).
    """
    if config is None:
        config = getattr(model, "config", None)
    model_config = getattr(model, "config", None)
    if model_config is not None:
        check_model_config(model_config)
        store_ops_implementation_as_dict(model_config)
    table = resolve(config, device_target=device_target, require=require, defaults=defaults)
    for module in model.modules():
        # object.__setattr__ bypasses nn.Module's registration: the table is neither state nor a child.
        object.__setattr__(module, ATTRIBUTE, table)
    return table


def of(module) -> OpTable:
    """The table bound to ``module``, or the process default (resolved from the environment on first use)."""
    table = getattr(module, ATTRIBUTE, None)
    return table if table is not None else default_table()


def is_bound(module) -> bool:
    """Whether ``module`` holds a table of its own (else ``of`` gives the process default)."""
    return getattr(module, ATTRIBUTE, None) is not None


def describe(module) -> str:
    """What ``module``'s forwards will run: its bound table (or the process default), printed.

    Inspection only: it resolves nothing and binds nothing, unlike calling ``bind`` again, which
    would replace the table (and, without ``defaults=``, drop the generated module's device defaults).
    """
    table = of(module)
    where = "bound at model build" if is_bound(module) else "not bound: the process default, from the environment"
    return f"{table.describe()}\n({where})"


def default_table() -> OpTable:
    """The process-wide table for unbound modules, resolved once from the environment alone."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = resolve(None)
    return _default


def reset_default() -> None:
    """Forget the process default (the next unbound ``of`` re-resolves from the environment)."""
    global _default
    _default = None
