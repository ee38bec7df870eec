"""Checks a device config's op_defaults against the run time's op slots and backend names.

A typo here would generate a module that cannot build a model, so it is refused at generation time.
This is the generator's one read of the run time: ``patchgen.kernels.registry`` as data (slot and
backend names, declared without importing torch or any kernel library).
"""

from __future__ import annotations

import difflib

from patchgen.errors import ConfigError

AUTO = "auto"


def check_op_defaults(op_defaults: dict[str, str], config_path: str) -> None:
    """ConfigError naming the config file, the bad slot or backend and its close match."""
    from patchgen.kernels import registry

    for slot, backend in sorted(op_defaults.items()):
        if slot not in registry.SLOTS:
            raise ConfigError(
                f"config {config_path}: op_defaults names unknown op slot {slot!r}{_hint(slot, registry.SLOTS)}; "
                f"slots are {', '.join(registry.SLOTS)}"
            )
        names = [h.name for h in registry.BACKENDS[slot]]
        if not isinstance(backend, str) or (backend != AUTO and backend not in names):
            raise ConfigError(
                f"config {config_path}: op_defaults {slot}={backend!r} names no backend"
                f"{_hint(str(backend), names)}; {slot} backends are {', '.join(names)} (or 'auto')"
            )


def _hint(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
