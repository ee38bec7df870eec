"""Generation refuses what would bind a name wrongly, lose an import it needs, or hide a crash."""

import itertools
import textwrap
from pathlib import Path

import pytest

from patchgen import cli
from patchgen.errors import ConfigError, PatchApplyError
from patchgen.pipeline import generate
from patchgen.source import UpstreamSource
from patchgen.spec import PatchConfig
from patchgen.targets import Target

MODULE = "tp.models.m.modeling_m"
_names = itertools.count()


@pytest.fixture
def bodies(tmp_path, monkeypatch):
    """Write a bodies module (a fresh name each time: parsed bodies are cached by name)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str, package: bool = False) -> str:
        name = f"safety_bodies_{next(_names)}"
        path = tmp_path / name / "__init__.py" if package else tmp_path / f"{name}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(source))
        return name

    return write


def run(upstream: str, config: PatchConfig):
    source = UpstreamSource(MODULE, Path("/nowhere/m.py"), textwrap.dedent(upstream), "1.0")
    return generate(Target(config.model, config.device), config=config, upstream=source)


def config(bodies_module: str) -> PatchConfig:
    return PatchConfig("m", "gpu", bodies=bodies_module, upstream_module=MODULE)


UPSTREAM = """
    from tp.utils import helper
    try:
        from fancy import fast_norm
    except ImportError:
        fast_norm = None

    def rotate_half(x):
        return -x

    class A:
        def forward(self, x):
            return helper(x)

    class Base:
        pass

    class B(Base):
        pass

    __all__ = ["A", "B"]
"""


def test_body_import_that_upstream_binds_otherwise_is_refused(bodies):
    for clash in ("from mykernels import rotate_half", "from mykernels import fast_norm"):
        name = bodies(f"{clash}\nclass A:\n    def forward(self, x):\n        return {clash.split()[-1]}(x)\n")
        cfg = config(name)
        cfg.override_method("A.forward", reason="r")
        with pytest.raises(PatchApplyError, match="but the upstream module binds .* import it under another name"):
            run(UPSTREAM, cfg)


def test_two_bodies_importing_one_name_from_two_places_are_refused(bodies):
    one = bodies("from ka import tool\nclass A:\n    def forward(self, x):\n        return tool(x)\n")
    two = bodies("from kb import tool\ndef rotate_half(x):\n    return tool(x)\n")
    cfg = config(one)
    cfg.override_method("A.forward", reason="r")
    cfg.replace_function("rotate_half", reason="r", body=f"{two}:rotate_half")
    with pytest.raises(PatchApplyError, match="import 'tool' from different places"):
        run(UPSTREAM, cfg)


def test_guarded_import_in_a_bodies_module_is_refused(bodies):
    name = bodies(
        "try:\n    from flash_attn import flash_fn\nexcept ImportError:\n    flash_fn = None\n"
        "class A:\n    def forward(self, x):\n        return flash_fn(x)\n"
    )
    cfg = config(name)
    cfg.override_method("A.forward", reason="r")
    with pytest.raises(ConfigError, match="imports inside a block \\(try/if\\)"):
        run(UPSTREAM, cfg)


def test_relative_import_in_a_bodies_package_resolves_inside_the_package(bodies):
    name = bodies("from .helpers import tool\nclass A:\n    def forward(self, x):\n        return tool(x)\n", package=True)
    cfg = config(name)
    cfg.override_method("A.forward", reason="r")
    assert f"from {name}.helpers import tool" in run(UPSTREAM, cfg).python


def test_excluding_a_class_that_remaining_code_reads_is_refused(bodies):
    cfg = config(bodies("x = 1\n"))
    cfg.exclude("Base", reason="r")
    with pytest.raises(PatchApplyError, match="excluded Base still read by code that remains"):
        run(UPSTREAM, cfg)


def test_imports_read_by_all_or_string_annotations_are_kept(bodies):
    upstream = """
        from tp.utils import Cache, Helper

        class A:
            def forward(self, x):
                return Helper(x)

        class C:
            def run(self, c: "Cache"):
                return c

        __all__ = ["A", "Helper"]
    """
    name = bodies("class A:\n    def forward(self, x):\n        return x\n")
    cfg = config(name)
    cfg.override_method("A.forward", reason="r")
    assert "from tp.utils import Cache, Helper" in run(upstream, cfg).python


def test_add_import_that_shadows_an_upstream_name_is_refused(bodies):
    cfg = config(bodies("x = 1\n"))
    cfg.add_import("from mytorch import helper", reason="r")
    with pytest.raises(PatchApplyError, match="add_import 'from mytorch import helper' imports 'helper'"):
        run(UPSTREAM, cfg)


@pytest.mark.parametrize("reason", ["drop\rimport os", "tab\tinside", "bell\x07"])
def test_reason_with_control_characters_is_refused(reason):
    with pytest.raises(ConfigError, match="reason must be one non-empty line"):
        PatchConfig("m", "gpu", bodies="b").override_method("A.forward", reason=reason)


@pytest.mark.parametrize("line", ["import os,", "from . import x", "import os; import sys", "x = 1"])
def test_add_import_must_parse_as_one_absolute_import(line):
    with pytest.raises(ConfigError, match="expected one 'import"):
        PatchConfig("m", "gpu").add_import(line, reason="r")


def test_a_crash_exits_3_never_1(monkeypatch, capsys):
    import patchgen.pipeline

    def boom(*args, **kwargs):
        raise ZeroDivisionError("x")

    monkeypatch.setattr(patchgen.pipeline, "generate", boom)
    assert cli.main(["--check"]) == 3
    assert "internal error: ZeroDivisionError" in capsys.readouterr().err


def test_check_sees_crlf_line_endings_on_disk(tmp_path, monkeypatch, capsys):
    import shutil

    from patchgen.targets import generated_dir

    copy = tmp_path / "generated"
    shutil.copytree(generated_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("PATCHGEN_OUTPUT_DIR", str(copy))
    path = copy / "qwen3_5" / "patched_modeling_qwen3_5_gpu.py"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    assert cli.main(["--check", "qwen3_5/gpu"]) == 1
