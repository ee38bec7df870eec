"""names_used: the fast read-only walk equals a plain libcst visitor on real and tricky code."""

import re

import libcst as cst
import pytest

from patchgen.codemods.names import names_used
from patchgen.source import load_upstream


def names_by_visitor(node: cst.CSTNode) -> set[str]:
    """The reference: a libcst visitor (slow: it rebuilds every node it passes)."""
    used: set[str] = set()
    strings_count = [0]  # > 0 inside an annotation or an `__all__` assignment

    class Collector(cst.CSTVisitor):
        def visit_Import(self, _):
            return False

        def visit_ImportFrom(self, _):
            return False

        def visit_Attribute(self, attribute: cst.Attribute):
            attribute.value.visit(self)  # the attribute's own name is not a read of a global
            return False

        def visit_Name(self, name: cst.Name):
            used.add(name.value)

        def visit_Annotation(self, _):
            strings_count[0] += 1

        def leave_Annotation(self, _):
            strings_count[0] -= 1

        def visit_Assign(self, assign: cst.Assign):
            if any(isinstance(t.target, cst.Name) and t.target.value == "__all__" for t in assign.targets):
                strings_count[0] += 1

        def leave_Assign(self, assign: cst.Assign):
            if any(isinstance(t.target, cst.Name) and t.target.value == "__all__" for t in assign.targets):
                strings_count[0] -= 1

        def visit_SimpleString(self, string: cst.SimpleString):
            if strings_count[0] > 0:
                value = string.evaluated_value
                if isinstance(value, str):
                    used.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", value))

    node.visit(Collector())
    return used


TRICKY = """
import os, sys as system
from typing import Optional
__all__ = ["Exported", "other_thing"]
def f(x: "Optional[Thing]", *, key=os.sep) -> "Result":
    call(keyword=value, **extra)
    obj.attribute.chain(inner)
    return [y for y in range(x) if y in system.path] + f"{formatted!r}"
class C(Base, metaclass=Meta):
    field: "Annotated[int, 'note']" = default
    def g(self):
        import json
        return json.dumps(self)
"""


def test_tricky_snippet_equals_the_visitor():
    module = cst.parse_module(TRICKY)
    assert names_used(module) == names_by_visitor(module)
    for statement in module.body:
        assert names_used(statement) == names_by_visitor(statement)


def test_strings_count_only_in_annotations_and_all():
    module = cst.parse_module(TRICKY)
    used = names_used(module)
    assert {"Exported", "other_thing", "Thing", "Result", "Annotated", "note"} <= used
    assert "os" in used and "attribute" not in used and "json" in used


@pytest.mark.parametrize("module", ["transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"])
def test_upstream_modules_equal_the_visitor_statement_by_statement(module):
    tree = cst.parse_module(load_upstream(module).text)
    for statement in tree.body:
        assert names_used(statement) == names_by_visitor(statement)


def test_module_answer_is_cached_per_statement_and_stays_correct_after_an_edit():
    module = cst.parse_module("a = b\nc = d\n")
    assert names_used(module) == {"a", "b", "c", "d"}
    edited = module.with_changes(body=[module.body[0], cst.parse_statement("c = e\n")])
    assert names_used(edited) == {"a", "b", "c", "e"}
