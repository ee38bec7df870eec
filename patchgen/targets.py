"""Targets: (model, device) pairs, each with a config module patchgen/configs/<model>/<device>.py."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import traceback
from pathlib import Path

from patchgen.errors import ConfigError, OutputError, UnknownTarget
from patchgen.op_defaults import check_op_defaults
from patchgen.spec import PatchConfig

DEVICES = ("gpu", "npu")
CONFIG_PACKAGE = "patchgen.configs"


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {package} not found: is patchgen installed (make setup)?")
    return Path(next(iter(spec.submodule_search_locations)))


def configs_dir() -> Path:
    return _package_dir(CONFIG_PACKAGE)


def generated_dir() -> Path:
    """Where generated files live: the `patchgen.generated` package, or $PATCHGEN_OUTPUT_DIR if set."""
    override = os.environ.get("PATCHGEN_OUTPUT_DIR")
    if override and override != override.strip():
        # a path padded by a stray space names another folder (or, all blanks, a folder of blanks here)
        raise OutputError(
            f"PATCHGEN_OUTPUT_DIR={override!r} begins or ends with whitespace: "
            "set it to the folder's path alone, or unset it for the checked-in generated/"
        )
    return Path(override) if override else _package_dir("patchgen.generated")


@dataclasses.dataclass(frozen=True)
class Target:
    model: str
    device: str

    @property
    def name(self) -> str:
        return f"{self.model}/{self.device}"

    @property
    def config_module(self) -> str:
        return f"{CONFIG_PACKAGE}.{self.model}.{self.device}"

    @property
    def config_path(self) -> str:
        """Repository-relative path of the config, as printed in generated headers."""
        return f"patchgen/configs/{self.model}/{self.device}.py"

    @property
    def output_name(self) -> str:
        return f"patched_modeling_{self.model}_{self.device}"

    def output_path(self, root: Path | None = None) -> Path:
        return (root or generated_dir()) / self.model / f"{self.output_name}.py"

    def diff_path(self, root: Path | None = None) -> Path:
        return (root or generated_dir()) / self.model / f"{self.output_name}.diff"

    def load_config(self) -> PatchConfig:
        try:
            module = importlib.import_module(self.config_module)
        except Exception as exc:  # a broken config is a configuration error naming the file
            last = traceback.extract_tb(exc.__traceback__)[-1]
            raise ConfigError(
                f"config {self.config_path} failed to import: {type(exc).__name__}: {exc} "
                f"(at {Path(last.filename).name}:{last.lineno})"
            ) from exc
        config = getattr(module, "config", None)
        if not isinstance(config, PatchConfig):
            raise ConfigError(f"config {self.config_path} must define `config = PatchConfig(...)`")
        if (config.model, config.device) != (self.model, self.device):
            raise ConfigError(
                f"config {self.config_path} declares model={config.model!r} device={config.device!r}; "
                f"it must match its path ({self.model!r}, {self.device!r})"
            )
        check_op_defaults(config.op_defaults, self.config_path)
        return config


def all_targets() -> list[Target]:
    found = []
    for model_dir in sorted(p for p in configs_dir().iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        for device in DEVICES:
            if (model_dir / f"{device}.py").exists():
                found.append(Target(model_dir.name, device))
    if not found:
        raise ConfigError(f"no targets: no patchgen/configs/<model>/<device>.py found in {configs_dir()}")
    return found


def find_target(model: str | None, device: str | None) -> Target:
    targets = all_targets()
    models = sorted({t.model for t in targets})
    if model not in models:
        raise UnknownTarget(f"unknown model {model!r}: known models are {', '.join(models)} (patchgen --list)")
    devices = sorted(t.device for t in targets if t.model == model)
    if device not in devices:
        raise UnknownTarget(f"unknown device {device!r} for model {model!r}: known devices are {', '.join(devices)}")
    return Target(model, device)


def parse_target(text: str) -> Target:
    """`qwen3_5/gpu` or `qwen3_5:gpu` -> Target (validated)."""
    for sep in ("/", ":"):
        if sep in text:
            model, device = text.split(sep, 1)
            return find_target(model, device)
    raise UnknownTarget(f"target {text!r} must be MODEL/DEVICE, e.g. qwen3_5/gpu (patchgen --list)")
