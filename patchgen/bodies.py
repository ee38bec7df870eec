"""Reads replacement bodies from their (never imported) bodies modules, with the imports they need."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import libcst as cst
from libcst.metadata import Access, BuiltinScope, GlobalScope, MetadataWrapper, ScopeProvider

from patchgen.codemods.absolute_imports import AbsoluteImports
from patchgen.codemods.names import import_bindings, subtree_ids, top_level_import_nodes
from patchgen.errors import ConfigError
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
    accesses: list[Access]  # every name read anywhere in the module, with what it resolves to
    path: Path


@functools.cache
def _parse(module_name: str) -> _ParsedBodies:
    path = module_file(module_name)
    try:
        tree = cst.parse_module(read_source(path, "save the bodies module as UTF-8"))
    except cst.ParserSyntaxError as exc:
        raise ConfigError(f"bodies module {module_name} ({path}) does not parse: {exc}") from None
    tree = tree.visit(AbsoluteImports(module_name, is_package=path.name == "__init__.py"))
    wrapper = MetadataWrapper(tree, unsafe_skip_copy=True)  # the tree is ours alone: no defensive deep copy
    scopes = {scope for scope in wrapper.resolve(ScopeProvider).values() if scope is not None}
    return _ParsedBodies(wrapper.module, [access for scope in scopes for access in scope.accesses], path)


@functools.cache  # the gpu and npu targets (and a renamed sibling model) share their bodies
def load_body(module_name: str, qualname: str, expected: str) -> Body:
    """The class, function or method `qualname` of `module_name`; `expected` is its kind."""
    parsed = _parse(module_name)
    node = _find(parsed.module, qualname)
    where = f"{module_name}:{qualname}"
    if node is None:
        raise ConfigError(f"body {where} not found in {parsed.path}: define it there, or point body= at it")
    kind = "class" if isinstance(node, cst.ClassDef) else ("method" if "." in qualname else "function")
    # A top-level function may serve as a method body (and the reverse): both are FunctionDefs.
    if kind != expected and "class" in (kind, expected):
        raise ConfigError(f"body {where} is a {kind}, but the patch needs a {expected}")

    inside = subtree_ids(node)
    imports: dict[str, cst.Import | cst.ImportFrom] = {}
    unresolved: set[str] = set()
    unguarded = top_level_import_nodes(parsed.module)
    for access in parsed.accesses:
        if id(access.node) not in inside:
            continue
        name = access.node.value if isinstance(access.node, cst.Name) else None
        referents = list(access.referents)
        if not referents:
            if name:
                unresolved.add(name)
            continue
        if all(isinstance(r.scope, BuiltinScope) for r in referents):
            continue
        for referent in referents:
            if not isinstance(referent.scope, GlobalScope):
                continue
            bound = referent.name
            statement = referent.node
            if isinstance(statement, (cst.Import, cst.ImportFrom)):
                if id(statement) not in unguarded:
                    raise ConfigError(
                        f"body {where} reads {bound!r}, which {module_name} imports inside a block (try/if): "
                        "the generated module would import it unguarded; import it at the top of the bodies "
                        "module, or put the fallback in patchgen.kernels and import that"
                    )
                imports[bound.split(".")[0]] = _single_alias(statement, bound)
            elif id(referent.node) not in inside:
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


def _find(module: cst.Module, qualname: str) -> cst.ClassDef | cst.FunctionDef | None:
    head, _, method = qualname.partition(".")
    for stmt in module.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)) and stmt.name.value == head:
            if not method:
                return stmt
            if isinstance(stmt, cst.ClassDef):
                for inner in stmt.body.body:
                    if isinstance(inner, cst.FunctionDef) and inner.name.value == method:
                        return inner
            return None
    return None
