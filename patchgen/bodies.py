"""Reads replacement bodies from their (never imported) bodies modules, with the imports they need."""

from __future__ import annotations

import builtins
import dataclasses
import functools
from pathlib import Path

import libcst as cst

from patchgen.codemods.absolute_imports import AbsoluteImports
from patchgen.codemods.names import import_bindings, top_level_import_nodes
from patchgen.errors import ConfigError
from patchgen.scopes import ModuleScope, global_reads
from patchgen.source import module_file, read_source


@dataclasses.dataclass(frozen=True)
class Body:
    """A body definition and, for every global name it reads, the import that binds it."""

    node: cst.ClassDef | cst.FunctionDef
    imports: dict[str, cst.Import | cst.ImportFrom]  # name -> a one-alias import statement
    unresolved: frozenset[str]  # read but bound nowhere in the bodies module (must be defined upstream)
    source: str  # "module:qualname", for messages


@dataclasses.dataclass
class _ParsedBodies:
    module: cst.Module
    scope: ModuleScope  # what the module binds at module level
    unguarded: set[int]  # ids of the imports that stand at module level outside any if/try block
    path: Path


@functools.cache
def _parse(module_name: str) -> _ParsedBodies:
    path = module_file(module_name)
    try:
        tree = cst.parse_module(read_source(path, "save the bodies module as UTF-8"))
    except cst.ParserSyntaxError as exc:
        raise ConfigError(f"bodies module {module_name} ({path}) does not parse: {exc}") from None
    tree = tree.visit(AbsoluteImports(module_name, is_package=path.name == "__init__.py"))
    return _ParsedBodies(tree, ModuleScope.of(tree), top_level_import_nodes(tree), path)


@functools.cache  # the gpu and npu targets (and a renamed sibling model) share their bodies
def load_body(module_name: str, qualname: str, expected: str) -> Body:
    """The class, function or method `qualname` of `module_name`; `expected` is its kind."""
    parsed = _parse(module_name)
    node, enclosing_class = _find(parsed.module, qualname)
    where = f"{module_name}:{qualname}"
    if node is None:
        raise ConfigError(f"body {where} not found in {parsed.path}: define it there, or point body= at it")
    kind = "class" if isinstance(node, cst.ClassDef) else ("method" if "." in qualname else "function")
    # A top-level function may serve as a method body (and the reverse): both are FunctionDefs.
    if kind != expected and "class" in (kind, expected):
        raise ConfigError(f"body {where} is a {kind}, but the patch needs a {expected}")

    imports: dict[str, cst.Import | cst.ImportFrom] = {}
    unresolved: set[str] = set()
    for read in global_reads(node, enclosing_class, parsed.scope):
        bound = read.name
        bindings = parsed.scope.bindings.get(bound)
        if not bindings:
            if not read.in_string and not hasattr(builtins, bound):
                unresolved.add(bound)
            continue
        for binding in bindings:
            if isinstance(binding, (cst.Import, cst.ImportFrom)):
                if id(binding) not in parsed.unguarded:
                    raise ConfigError(
                        f"body {where} reads {bound!r}, which {module_name} imports inside a block (try/if): "
                        "the generated module would import it unguarded; import it at the top of the bodies "
                        "module, or put the fallback in patchgen.kernels and import that"
                    )
                imports[bound.split(".")[0]] = _single_alias(binding, bound)
            elif binding is not node:
                # Defined by the bodies module itself (usually the upstream-named class a method sits in):
                # the generated module must define it too, which the pipeline checks.
                unresolved.add(bound)
    return Body(node, imports, frozenset(unresolved), where)


def _single_alias(statement: cst.Import | cst.ImportFrom, bound: str) -> cst.Import | cst.ImportFrom:
    for alias in statement.names:
        single = statement.with_changes(names=[alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)], lpar=None, rpar=None) \
            if isinstance(statement, cst.ImportFrom) else statement.with_changes(names=[alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)])
        if bound.split(".")[0] in import_bindings(single):
            return single
    raise AssertionError(f"{bound} not bound by its import")


def _find(module: cst.Module, qualname: str) -> tuple[cst.ClassDef | cst.FunctionDef | None, cst.ClassDef | None]:
    """The definition `qualname` names and, for a method, the class it sits in."""
    head, _, method = qualname.partition(".")
    for stmt in module.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)) and stmt.name.value == head:
            if not method:
                return stmt, None
            if isinstance(stmt, cst.ClassDef):
                for inner in stmt.body.body:
                    if isinstance(inner, cst.FunctionDef) and inner.name.value == method:
                        return inner, stmt
            return None, None
    return None, None
