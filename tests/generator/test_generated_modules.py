"""The checked-in generated modules: importable with run-time dependencies only, upstream's public API."""

import functools
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from patchgen.pins import TRANSFORMERS_PIN
from patchgen.targets import all_targets

REPO = Path(__file__).resolve().parents[2]
TARGETS = all_targets()


GENERATOR_ONLY = ("libcst", "jinja2", "patchgen.spec", "patchgen.pipeline", "patchgen.render", "patchgen.cli")


@functools.cache
def modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd="/", capture_output=True, text=True).stdout
    return {name for name in out.splitlines() if name.startswith(GENERATOR_ONLY)}


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_generated_module_imports_without_the_generator(target):
    """Nothing of the generator is loaded; jinja2 only as far as transformers itself loads it."""
    config = target.load_config()
    loaded = modules_after_import(f"patchgen.generated.{target.model}.{target.output_name}")
    assert loaded - modules_after_import(config.upstream_module) == set()
    assert not {m for m in loaded if m.startswith(("libcst", "patchgen"))}


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_generated_module_exports_upstream_public_names_minus_exclusions(target):
    config = target.load_config()
    generated = importlib.import_module(f"patchgen.generated.{target.model}.{target.output_name}")
    upstream = importlib.import_module(config.upstream_module)
    excluded = {config.resolved_target(p) for p in config.patches if p.verb == "exclude"}
    assert list(generated.__all__) == [name for name in upstream.__all__ if name not in excluded]
    for name in generated.__all__:
        assert getattr(generated, name).__module__ == generated.__name__


def test_header_records_the_pinned_transformers_version():
    for target in TARGETS:
        assert f"from transformers {TRANSFORMERS_PIN}." in target.output_path().read_text().splitlines()[0]


def test_pyproject_pins_the_same_transformers_release():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert f"transformers=={TRANSFORMERS_PIN}" in project["project"]["dependencies"]


def test_pyproject_lists_every_package_folder():
    """A wheel holds only the listed packages: a new sub-package must be added to pyproject."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for prefix, folder in tool["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((prefix, *relative)))
    assert found == listed


def test_top_level_import_names_are_not_kernels_or_generated():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(name.split(".")[0] == "patchgen" for name in tool["packages"])
    assert importlib.util.find_spec("patchgen.kernels").origin.endswith("kernels/__init__.py")
