"""What one generator process computes once and reuses, and that reuse never changes the output."""

import subprocess
import sys

import libcst as cst
import pytest

from patchgen import codegen, pipeline
from patchgen.codemods import names
from patchgen.codemods.absolute_imports import AbsoluteImports
from patchgen.errors import PatchTargetMissing
from patchgen.targets import Target


@pytest.fixture
def fresh_caches(monkeypatch):
    """Empty the pipeline's in-process caches, as in a new process."""

    def clear():
        monkeypatch.setattr(pipeline, "_PREPARED", {})
        monkeypatch.setattr(pipeline, "_EDITED", {})
        monkeypatch.setattr(codegen, "_STATEMENT_CODE", {})

    clear()
    return clear


def _devices(toy_config):
    toy_config.override_method("ToyNorm.forward", reason="norm through ops")
    toy_config.replace_function("toy_function", reason="add through ops")
    toy_config.exclude("ToyLegacy", reason="not needed")
    npu = toy_config.derive(device="npu", op_defaults={"rms_norm": "npu_rms_norm"})
    return toy_config, npu


def test_device_targets_of_one_model_share_one_edited_tree(toy_config, toy_upstream, fresh_caches):
    gpu, npu = _devices(toy_config)
    first = pipeline.edited_upstream(Target("toy", "gpu"), gpu, toy_upstream)
    assert pipeline.edited_upstream(Target("toy", "npu"), npu, toy_upstream) is first


def test_a_device_generated_after_its_sibling_is_byte_identical_to_one_generated_alone(
    toy_config, toy_upstream, fresh_caches
):
    gpu, npu = _devices(toy_config)
    pipeline.generate(Target("toy", "gpu"), gpu, toy_upstream)
    after_sibling = pipeline.generate(Target("toy", "npu"), npu, toy_upstream)
    fresh_caches()
    alone = pipeline.generate(Target("toy", "npu"), npu, toy_upstream)
    assert after_sibling.python == alone.python
    assert after_sibling.diff == alone.diff
    assert 'PATCHGEN_DEVICE = "npu"' in alone.python and '"rms_norm": "npu_rms_norm",' in alone.python


def test_a_changed_patch_list_is_edited_anew(toy_config, toy_generate, fresh_caches):
    toy_config.override_method("ToyNorm.forward", reason="norm through ops")
    assert "patchgen[replace_function]" not in toy_generate(toy_config).python
    toy_config.replace_function("toy_function", reason="add through ops")
    assert "# patchgen[replace_function]: add through ops\ndef toy_function(x):" in toy_generate(toy_config).python


def test_a_changed_upstream_text_is_edited_anew(toy_config, toy_upstream, fresh_caches):
    toy_config.override_method("ToyNorm.forward", reason="r")
    pipeline.generate(Target("toy", "gpu"), toy_config, toy_upstream)
    changed = toy_upstream.__class__(
        toy_upstream.module, toy_upstream.path, toy_upstream.text.replace("return x + 1", "return x + 2"), "9.9.9"
    )
    assert "return x + 2" in pipeline.generate(Target("toy", "gpu"), toy_config, changed).python


def test_a_failing_target_fails_for_every_device(toy_config, toy_upstream, fresh_caches):
    toy_config.override_method("ToyNorm.backward", reason="r")
    npu = toy_config.derive(device="npu")
    for target, config in ((Target("toy", "gpu"), toy_config), (Target("toy", "npu"), npu)):
        with pytest.raises(PatchTargetMissing, match="ToyNorm has no method 'backward'"):
            pipeline.generate(target, config, toy_upstream)


@pytest.mark.parametrize(
    "source",
    [
        "import os\n\n\nclass A:\n    def f(self):\n        return os.sep  # why\n",
        "# licence\n\n'''doc'''\nx = 1\n\n# trailing comment\n",
        "def f():\r\n\treturn 1\r\n",
        "x = 1",  # no trailing newline
        "",
        "# only a comment\n",
        "if x:\n    pass\nelse:\n    y = 2\n\n\n\n",
    ],
    ids=["class", "header-footer", "crlf-tabs", "no-newline", "empty", "comment-only", "blank-tail"],
)
def test_module_code_is_libcst_code(source, fresh_caches):
    module = cst.parse_module(source)
    assert codegen.module_code(module) == module.code == source


def test_module_code_reuses_a_statement_shared_by_two_modules(fresh_caches):
    module = cst.parse_module("import os\n\n\ndef f():\n    return os.sep\n")
    extended = module.with_changes(body=[*module.body, cst.parse_statement("y = 2\n")])
    assert codegen.module_code(module) == module.code
    assert codegen.module_code(extended) == extended.code
    assert len(codegen._STATEMENT_CODE) == 3  # import, def, and the new line: the shared two rendered once


def test_names_of_an_edited_class_are_read_again_but_its_untouched_methods_are_not(monkeypatch):
    monkeypatch.setattr(names, "_STATEMENT_NAMES", {})
    module = cst.parse_module(
        "import os\n\n\nclass A:\n    def f(self):\n        return os.sep\n\n    def g(self):\n        return helper()\n"
    )
    assert names.names_used(module) == {"A", "f", "g", "os", "self", "helper"}  # a def's own name counts
    cls = module.body[-1]
    untouched = cls.body.body[1]
    new_f = cst.parse_module("def f(self):\n    return other()\n").body[0]
    edited = module.with_changes(body=[module.body[0], cls.with_changes(body=cls.body.with_changes(body=[new_f, untouched]))])
    assert names._STATEMENT_NAMES[id(untouched)][0] is untouched  # read by the first walk, reused by the second
    assert names.names_used(edited) == {"A", "f", "g", "self", "other", "helper"}


NESTED = """\
from .configuration_m import MConfig
import os

if os.environ.get("X"):
    class A:
        def f(self):
            from ..utils import helper; return helper()
else:
    from . import sibling


class Untouched:
    def g(self):
        return os.sep
"""


def test_absolute_imports_rewrite_nested_relative_imports_only():
    module = cst.parse_module(NESTED)
    out = module.visit(AbsoluteImports("pkg.models.m.modeling_m"))
    assert out.code == (
        NESTED.replace("from .configuration_m", "from pkg.models.m.configuration_m")
        .replace("from ..utils import", "from pkg.models.utils import")
        .replace("from . import sibling", "from pkg.models.m import sibling")
    )
    assert out.body[1] is module.body[1] and out.body[3] is module.body[3]  # nothing else rebuilt
    assert names.names_used(out) == names.names_used(module)


def test_a_module_without_relative_imports_is_returned_as_it_is():
    module = cst.parse_module("import os\n\n\ndef f():\n    from os import path\n    return path\n")
    assert module.visit(AbsoluteImports("pkg.m")) is module


def test_check_imports_neither_torch_nor_transformers():
    """The generator reads upstream source files; importing the libraries would cost seconds."""
    code = (
        "import sys\nfrom patchgen.cli import main\nrc = main(['--check'])\n"
        "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.splitlines()[-1] == "0 []"
