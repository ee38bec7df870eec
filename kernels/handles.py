"""Kernel handles: one object per backend of an op slot.

A handle knows the distributions it needs (with PEP 440 bounds, read from distribution
metadata, never by importing), its capability flags, and where its entry point lives. It
decides availability once, caches the verdict (failures included, with the reason) and loads
the entry point lazily. Deciding availability never creates a tensor or synchronises a device.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from . import capabilities as caps
from .errors import BackendUnavailable, SettingError


@dataclass(frozen=True)
class Requirement:
    """A distribution a backend needs, with an optional PEP 440 specifier such as ``>=0.6,<0.7``."""

    distribution: str
    specifier: str = ""

    def __str__(self) -> str:
        return f"{self.distribution}{self.specifier}"

    def problem(self) -> str | None:
        """Why the installed distribution does not satisfy this requirement, or None if it does."""
        try:
            # Looked up through the module attribute so that tests can fake the metadata.
            found = metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            return f"needs {self}, not installed (pip install '{self}')"
        if not self.specifier:
            return None
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            ok = Version(found) in SpecifierSet(self.specifier, prereleases=True)
        except (InvalidSpecifier, InvalidVersion):
            ok = False
        return None if ok else f"needs {self}, found {found}"


def cuda_present() -> str | None:
    """Reason why no CUDA device can be used, or None. Queries the driver, creates no context."""
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device, none is visible"


EntryPoint = str | Callable[[], Callable]


class KernelHandle:
    """One backend of one op slot: requirements, capabilities, cached availability, lazy entry point.

    ``entry`` is ``"package.module:function"`` (imported on first use) or a zero-argument loader
    returning the function. ``check`` is an extra availability test returning a reason or None.
    """

    def __init__(
        self,
        slot: str,
        name: str,
        entry: EntryPoint,
        *,
        requires: tuple[Requirement, ...] = (),
        capabilities: frozenset[str] | set[str] = frozenset(),
        check: Callable[[], str | None] | None = None,
        summary: str = "",
        dtypes: frozenset[str] | set[str] = caps.HALF_AND_FLOAT32,
    ):
        unknown = set(capabilities) - caps.ALL
        if unknown:
            raise ValueError(f"handle {slot}/{name}: unknown capabilities {sorted(unknown)}")
        self.slot, self.name, self.entry = slot, name, entry
        self.requires = tuple(requires)
        self.capabilities = frozenset(capabilities)
        self.dtypes = frozenset(dtypes) | ({"float64"} if caps.FLOAT64 in self.capabilities else frozenset())
        self.check = check
        self.summary = summary
        self._lock = threading.Lock()
        self._decided = False
        self._fn: Callable | None = None
        self._reason: str | None = None

    @property
    def needs_gpu(self) -> bool:
        return caps.NEEDS_GPU in self.capabilities

    @property
    def available(self) -> bool:
        """Whether the entry point loads here; decided once (see ``reset``)."""
        self._decide()
        return self._fn is not None

    @property
    def reason(self) -> str | None:
        """Why the backend is unavailable, or None when it is available."""
        self._decide()
        return self._reason

    def missing(self, required: set[str] | frozenset[str]) -> frozenset[str]:
        """The required capabilities this backend lacks."""
        return frozenset(required) - self.capabilities

    def serves(self, dtype) -> bool:
        """Whether this backend computes in ``dtype`` (a torch dtype or its name, e.g. ``"float64"``)."""
        return dtype_name(dtype) in self.dtypes

    def load(self) -> Callable:
        """The entry point; raises BackendUnavailable with the cached reason when it cannot load."""
        self._decide()
        if self._fn is None:
            raise BackendUnavailable(self.slot, self.name, self._reason or "unknown reason")
        return self._fn

    def reset(self) -> None:
        """Forget the cached verdict so that the next query checks and loads again."""
        with self._lock:
            self._decided, self._fn, self._reason = False, None, None

    def _decide(self) -> None:
        if self._decided:
            return
        with self._lock:
            if self._decided:
                return
            try:
                self._fn, self._reason = self._try_load(), None
            except SettingError:
                # the user's own setting (a misspelt PATCHGEN_TRITON_CONV preset) is wrong, not the backend:
                # taken for "unavailable", `auto` and the device defaults would silently run the next backend
                raise
            except Exception as exc:  # noqa: BLE001 - any other failure becomes the cached reason
                self._fn, self._reason = None, _describe(exc)
            self._decided = True

    def _try_load(self) -> Callable:
        for requirement in self.requires:
            problem = requirement.problem()
            if problem:
                raise _Unmet(problem)
        if self.needs_gpu and (problem := cuda_present()):
            raise _Unmet(problem)
        if self.check is not None and (problem := self.check()):
            raise _Unmet(problem)
        if callable(self.entry):
            return self.entry()
        module_name, _, attribute = self.entry.partition(":")
        return getattr(importlib.import_module(module_name), attribute)

    def __repr__(self) -> str:
        state = (
            "unchecked"
            if not self._decided
            else ("available" if self._fn else f"unavailable: {self._reason}")
        )
        return f"KernelHandle({self.slot}/{self.name}, {state})"


def dtype_name(dtype) -> str:
    """``torch.float64`` -> ``"float64"``; a name is returned as is."""
    return str(dtype).removeprefix("torch.")


class _Unmet(Exception):
    """A requirement or check that failed; its message is the whole reason."""


def _describe(exc: Exception) -> str:
    if isinstance(exc, _Unmet):
        return str(exc)
    return f"loading failed with {type(exc).__name__}: {exc}"
