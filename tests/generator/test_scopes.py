"""global_reads: the module-level names a body reads, by Python's scope rules.

Checked two ways: exact expected reads on small snippets (one scope rule each), and agreement with libcst's
ScopeProvider (the reference it replaced: slower, it analyses the whole module) on every definition of
the real bodies modules and an upstream modeling module.
"""

import builtins
import textwrap
from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import BuiltinScope, GlobalScope, MetadataWrapper, ScopeProvider

from patchgen.codemods.names import child_nodes
from patchgen.scopes import ModuleScope, global_reads
from patchgen.source import load_upstream, module_file

FIXTURES = Path(__file__).parent / "fixtures"


def definitions(module: cst.Module):
    """(qualname, node, enclosing class) of every top-level function and class and every method."""
    for statement in module.body:
        if isinstance(statement, (cst.ClassDef, cst.FunctionDef)):
            yield statement.name.value, statement, None
            if isinstance(statement, cst.ClassDef):
                for inner in statement.body.body:
                    if isinstance(inner, cst.FunctionDef):
                        yield f"{statement.name.value}.{inner.name.value}", inner, statement


def fast_outcome(scope: ModuleScope, node, enclosing) -> set[tuple]:
    """What each module-scope read resolves to: an import statement, another module-level binding, a
    builtin, or nothing (a bare name only: a string annotation naming nothing is not code to carry)."""
    found = set()
    for read in global_reads(node, enclosing, scope):
        bindings = scope.bindings.get(read.name)
        if not bindings:
            if hasattr(builtins, read.name):
                found.add(("builtin", read.name))
            elif not read.in_string:
                found.add(("unbound", read.name))
            continue
        for binding in bindings:
            if isinstance(binding, (cst.Import, cst.ImportFrom)):
                found.add(("import", read.name, id(binding)))
            elif binding is not node:
                found.add(("defined", read.name))
    return found


def reference_outcomes(accesses, defs) -> list[set[tuple]]:
    """The same from ScopeProvider's accesses (the way patchgen/bodies.py read them before), per definition."""
    owners: dict[int, list[int]] = {}  # id(node) -> indices of the definitions that hold it
    inside: list[set[int]] = []
    for index, (_, node, _) in enumerate(defs):
        pending, ids = [node], set()
        while pending:
            current = pending.pop()
            ids.add(id(current))
            owners.setdefault(id(current), []).append(index)
            pending.extend(child_nodes(current))
        inside.append(ids)
    found: list[set[tuple]] = [set() for _ in defs]
    for access in accesses:
        referents = list(access.referents)
        for index in owners.get(id(access.node), ()):
            if not referents and isinstance(access.node, cst.Name):
                found[index].add(("unbound", access.node.value))
            for referent in referents:
                if isinstance(referent.scope, BuiltinScope):
                    found[index].add(("builtin", referent.name))
                elif isinstance(referent.scope, GlobalScope):
                    if isinstance(referent.node, (cst.Import, cst.ImportFrom)):
                        found[index].add(("import", referent.name, id(referent.node)))
                    elif id(referent.node) not in inside[index]:
                        found[index].add(("defined", referent.name))
    return found


def agreement(source: str) -> dict[str, tuple[set, set]]:
    """qualname -> (fast only, reference only) for every definition that the two read differently."""
    module = cst.parse_module(source)
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    scopes = {scope for scope in wrapper.resolve(ScopeProvider).values() if scope is not None}
    accesses = [access for scope in scopes for access in scope.accesses]
    scope = ModuleScope.of(module)
    defs = list(definitions(module))
    reference = reference_outcomes(accesses, defs)
    differ = {}
    for (qualname, node, enclosing), expected in zip(defs, reference):
        fast = fast_outcome(scope, node, enclosing)
        if fast != expected:
            differ[qualname] = (fast - expected, expected - fast)
    return differ


@pytest.mark.parametrize(
    "module",
    ["patchgen.configs.qwen3_5.bodies", "patchgen.configs.qwen3_5_moe.bodies", "fixture_bodies.toy"],
)
def test_bodies_modules_read_as_scope_provider_reads_them(module, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    assert agreement(module_file(module).read_text()) == {}


def test_an_upstream_modeling_module_reads_as_scope_provider_reads_it():
    upstream = load_upstream("transformers.models.qwen3_5.modeling_qwen3_5")
    assert agreement(upstream.text) == {}


def reads(source: str, qualname: str) -> set[str]:
    """Names that `qualname` in `source` reads from the module scope (string reads marked "str:")."""
    module = cst.parse_module(textwrap.dedent(source))
    node, enclosing = next((n, e) for q, n, e in definitions(module) if q == qualname)
    return {("str:" if r.in_string else "") + r.name for r in global_reads(node, enclosing, ModuleScope.of(module))}


def test_a_name_bound_anywhere_in_a_function_is_local_there():
    source = """
        def f(a, *rest, key=None, **extra):
            print(x, a, rest, key, extra)
            x = 1
            for item in y:
                pass
            with open(z) as handle, ctx() as (first, second):
                pass
            try:
                pass
            except OSError as error:
                return item, handle, first, second, error
    """
    assert reads(source, "f") == {"None", "print", "y", "open", "z", "ctx", "OSError"}  # None: a builtin


def test_a_class_body_reads_a_module_name_until_it_assigns_its_own():
    source = """
        class Namespace:
            IO = IO
            alias = IO
            if flag:
                def kill(self): ...
                terminate = kill
    """
    assert reads(source, "Namespace") == {"IO", "flag"}


def test_a_method_does_not_see_its_class_names_but_its_decorators_do():
    source = """
        class A:
            scale = 2

            @property
            def value(self):
                return 1

            @value.setter
            def value(self, v, factor=scale):
                return scale
    """
    assert reads(source, "A.value") == {"property"}  # the first `value`, the getter
    module = cst.parse_module(textwrap.dedent(source))
    setter = [n for q, n, _ in definitions(module) if q == "A.value"][1]
    cls = module.body[0]
    assert {r.name for r in global_reads(setter, cls, ModuleScope.of(module))} == {"scale"}


def test_comprehension_variables_are_local_and_its_first_iterable_is_read_outside():
    source = """
        class Table:
            NAMES = ["a"]
            upper = [name.upper() for name in NAMES if name != NAMES]
    """
    # The first iterable runs in the class body (sees NAMES); the condition runs in the comprehension's
    # own scope, which does not see the class body: its NAMES is the module's.
    assert reads(source, "Table") == {"NAMES"}


def test_enclosing_function_names_are_not_module_reads_unless_declared_global():
    source = """
        def outer(a):
            b = 1
            def inner():
                nonlocal b
                global counter
                return a, b, counter, other
            return inner
    """
    assert reads(source, "outer") == {"counter", "other"}


def test_defaults_annotations_and_decorators_are_read_where_the_def_stands():
    source = """
        @decorate(option)
        def f(x: Tensor = default, *, y: "Cache | None" = None) -> Output:
            return x
    """
    assert reads(source, "f") == {"decorate", "option", "Tensor", "default", "str:Cache", "str:None", "None", "Output"}


def test_strings_are_read_as_code_only_where_they_are_types():
    source = """
        from typing import Literal, Optional, cast

        def f(x: Literal["mode"], y: Optional["Config"]) -> "torch.Tensor":
            label = "not_a_name"
            return cast("Model", x), Optional["Other"], label
    """
    assert reads(source, "f") == {
        "Literal", "Optional", "cast", "str:Config", "str:torch", "str:Model", "str:Other",
    }


def test_an_attribute_chain_reads_the_longest_dotted_import_it_starts_with():
    source = """
        import torch
        import torch.nn.functional

        def f(x):
            return torch.nn.functional.silu(x) + torch.zeros(1)
    """
    assert reads(source, "f") == {"torch.nn.functional", "torch"}


def test_keywords_and_attribute_names_are_not_reads():
    assert reads("def f(x):\n    return x.ops(dim=size)\n", "f") == {"size"}


def test_assignment_expressions_in_a_comprehension_bind_in_the_function():
    source = """
        def f(values):
            kept = [last := v for v in values]
            return last, kept
    """
    assert reads(source, "f") == set()


def test_match_captures_are_local():
    source = """
        def f(value):
            match value:
                case Point(x=px, y=0) | [px, *_]:
                    return px
                case {"k": kv, **others}:
                    return kv, others
                case other:
                    return other
    """
    assert reads(source, "f") == {"Point"}


def test_f_string_parts_of_a_concatenated_string_are_read():
    source = """
        def f(x):
            raise TypeError("expected a config, got" f" {type(x)} ({LIMIT})")
    """
    assert reads(source, "f") == {"TypeError", "type", "LIMIT"}


def test_module_bindings_cover_guarded_blocks_and_dotted_imports():
    module = cst.parse_module(textwrap.dedent("""
        import a.b.c
        try:
            from fast import kernel
        except ImportError:
            kernel = None
        for index in range(2):
            pass
        class K: ...
    """))
    bindings = ModuleScope.of(module).bindings
    assert set(bindings) == {"a", "a.b", "a.b.c", "kernel", "index", "K"}
    assert [type(node).__name__ for node in bindings["kernel"]] == ["ImportFrom", "Try"]
