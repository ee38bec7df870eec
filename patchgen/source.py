"""Locates upstream source files from distribution metadata, without importing transformers."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import re
import zipfile
import zlib
from pathlib import Path

from patchgen.errors import InputError, SourceNotFound, VersionMismatch
from patchgen.pins import TRANSFORMERS_PIN


@dataclasses.dataclass(frozen=True)
class UpstreamSource:
    """One upstream module's text, where it came from and which release it belongs to."""

    module: str  # dotted name, e.g. transformers.models.qwen3_5.modeling_qwen3_5
    path: Path
    text: str
    version: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def installed_transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise VersionMismatch(
            f"pinned transformers {TRANSFORMERS_PIN}, installed none: run `make setup` (pip install -e .)"
        ) from None


def check_pinned_version() -> str:
    """The installed transformers version, or VersionMismatch if it is not the pin."""
    found = installed_transformers_version()
    if found != TRANSFORMERS_PIN:
        raise VersionMismatch(
            f"pinned transformers {TRANSFORMERS_PIN}, installed {found}: install the pin "
            f"(pip install transformers=={TRANSFORMERS_PIN}) or bump it (docs/patchgen.md)"
        )
    return found


def load_upstream(module: str, source: TransformersSource | None = None) -> UpstreamSource:
    """Read a transformers module: from `source` (a wheel or directory) or the installed distribution."""
    if source is not None:
        return source.load(module)
    dist = importlib.metadata.distribution("transformers")
    relative = module.replace(".", "/") + ".py"
    path = Path(dist.locate_file(relative))
    if not path.is_file():
        raise SourceNotFound(
            f"upstream module {module} not found in transformers {dist.version} (looked for {path}); "
            "check the model name in the config's upstream_module"
        )
    return UpstreamSource(module, path, read_source(path, "reinstall transformers (make setup)"), dist.version)


def read_source(path: Path, fix: str) -> str:
    """A source file's text; InputError naming the file and ``fix`` when it is not UTF-8 or unreadable."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}: {fix}") from None
    return decode_source(data, path, fix)


def decode_source(data: bytes, where: Path | str, fix: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{where} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}): {fix}"
        ) from None


def module_file(module: str) -> Path:
    """File of a non-transformers module (a bodies module), found without executing it."""
    parent, _, _ = module.rpartition(".")
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as exc:
        raise SourceNotFound(f"module {module} not found ({exc}); check the body= reference or the bodies module") from None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise SourceNotFound(f"module {module} has no Python source file; check the body= reference (parent {parent})")
    return Path(spec.origin)


class TransformersSource:
    """transformers source other than the installed package: a wheel file or an unpacked directory.

    The version comes from the metadata next to the package (`*.dist-info/METADATA` or `PKG-INFO`).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.is_file() and self.path.suffix == ".whl":
            try:
                self._zip = zipfile.ZipFile(self.path)
            except (zipfile.BadZipFile, OSError) as exc:
                raise InputError(
                    f"--source {self.path} is not a readable wheel ({exc}): it is corrupt or truncated; "
                    "download it again (pip download transformers==VERSION --no-deps)"
                ) from None
            self._names = set(self._zip.namelist())
        elif self.path.is_dir():
            self._zip = None
        else:
            raise SourceNotFound(f"--source {self.path}: expected a transformers wheel (.whl) or an unpacked directory")
        self.version = self._read_version()

    def _read(self, relative: str) -> str | None:
        if self._zip is not None:
            if relative not in self._names:
                return None
            try:
                data = self._zip.read(relative)
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
                raise InputError(
                    f"--source {self.path}: {relative} cannot be read from the wheel ({exc}): it is corrupt or "
                    "truncated; download it again"
                ) from None
            return decode_source(data, f"--source {self.path}: {relative}", "the wheel is damaged; download it again")
        file = self.path / relative
        if not file.is_file():
            return None
        return read_source(file, f"restore it from the transformers release (--source {self.path})")

    def _read_version(self) -> str:
        if self._zip is not None:
            candidates = sorted(n for n in self._names if re.fullmatch(r"transformers-[^/]+\.dist-info/METADATA", n))
        else:
            candidates = sorted(
                str(p.relative_to(self.path)) for pattern in ("transformers-*.dist-info/METADATA", "PKG-INFO")
                for p in self.path.glob(pattern)
            )
        for name in candidates:
            match = re.search(r"^Version: *(\S+)", self._read(name) or "", re.MULTILINE)
            if match:
                return match.group(1)
        raise SourceNotFound(
            f"--source {self.path}: no transformers version metadata found "
            "(a transformers-*.dist-info/METADATA or PKG-INFO beside the transformers/ package)"
        )

    def load(self, module: str) -> UpstreamSource:
        relative = module.replace(".", "/") + ".py"
        text = self._read(relative)
        if text is None:
            raise SourceNotFound(
                f"upstream module {module} not found in {self.path} (transformers {self.version}): that release "
                "has no such model; give a release that has it (--source, or --base for upgrade-report)"
            )
        return UpstreamSource(module, self.path / relative, text, self.version)
