"""Helpers on dotted names and top-level definitions of a libcst module."""

from __future__ import annotations

import dataclasses
import re

import libcst as cst


def dotted_name(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{dotted_name(node.value)}.{node.attr.value}"
    raise TypeError(f"not a dotted name: {type(node).__name__}")


def dotted_node(dotted: str) -> cst.Name | cst.Attribute:
    parts = dotted.split(".")
    node: cst.Name | cst.Attribute = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def import_bindings(statement: cst.Import | cst.ImportFrom) -> dict[str, str]:
    """Names an import binds -> the dotted object each refers to (`import a.b` binds `a`)."""
    bound: dict[str, str] = {}
    if isinstance(statement, cst.Import):
        for alias in statement.names:
            full = dotted_name(alias.name)
            name = alias.asname.name.value if alias.asname else full.split(".")[0]
            bound[name] = full if alias.asname else name
        return bound
    if isinstance(statement.names, cst.ImportStar):
        return bound
    module = dotted_name(statement.module) if statement.module is not None else ""
    prefix = "." * len(statement.relative)
    for alias in statement.names:
        name = alias.asname.name.value if alias.asname else dotted_name(alias.name)
        bound[name] = f"{prefix}{module}.{dotted_name(alias.name)}"
    return bound


def module_level_statements(module: cst.Module):
    """Statements that run at module level: the module body and, recursively, the bodies of its
    `if` / `else` / `try` / `except` blocks (guarded imports and definitions)."""

    def walk(statements):
        for stmt in statements:
            if isinstance(stmt, cst.If):
                yield from walk(stmt.body.body)
                if isinstance(stmt.orelse, cst.Else):
                    yield from walk(stmt.orelse.body.body)
                elif stmt.orelse is not None:
                    yield from walk([stmt.orelse])
            elif isinstance(stmt, cst.Try):
                yield from walk(stmt.body.body)
                for handler in stmt.handlers:
                    yield from walk(handler.body.body)
            else:
                yield stmt

    return walk(module.body)


def top_level_definitions(module: cst.Module) -> dict[str, str]:
    """Names bound at module level -> kind ("class", "function", "import", "assign"), guarded blocks included."""
    found: dict[str, str] = {}
    for stmt in module_level_statements(module):
        if isinstance(stmt, cst.ClassDef):
            found[stmt.name.value] = "class"
        elif isinstance(stmt, cst.FunctionDef):
            found[stmt.name.value] = "function"
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    for name in import_bindings(small):
                        found.setdefault(name, "import")
                elif isinstance(small, (cst.Assign, cst.AnnAssign)):
                    targets = small.targets if isinstance(small, cst.Assign) else [small]
                    for target in targets:
                        if isinstance(target.target, cst.Name):
                            found.setdefault(target.target.value, "assign")
    return found


def class_methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    return {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}


# id(statement) -> (statement, names): a module's names are the union over its statements, and the
# codemods keep untouched statements (and the untouched methods of an edited class) as the same
# objects, so each is read once per process.
_STATEMENT_NAMES: dict[int, tuple[cst.CSTNode, frozenset[str]]] = {}


def names_used(node: cst.CSTNode) -> set[str]:
    """Every name read under node: Name nodes (not attribute names), and identifiers inside string
    annotations and `__all__` entries. Import statements are excluded."""
    if isinstance(node, cst.Module):
        used: set[str] = set()
        for stmt in node.body:
            used |= _statement_names(stmt)
        return used
    return _names_read(node)


def _statement_names(statement: cst.BaseStatement) -> frozenset[str]:
    cached = _STATEMENT_NAMES.get(id(statement))
    if cached is None or cached[0] is not statement:
        used: set[str] = set()
        _collect_children(statement, used, False)  # a statement is none of the kinds _collect_names singles out
        cached = _STATEMENT_NAMES[id(statement)] = (statement, frozenset(used))
    return cached[1]


def _names_read(node: cst.CSTNode) -> set[str]:
    used: set[str] = set()
    _collect_names(node, used, False)
    return used


# Child fields per node type. A read-only walk over the dataclass fields: libcst's visitors rebuild
# every node they pass, which made this the generator's slowest step.
_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _collect_names(node: cst.CSTNode, used: set[str], in_strings: bool) -> None:
    kind = type(node)
    if kind is cst.Name:
        used.add(node.value)
        return
    if kind is cst.Import or kind is cst.ImportFrom:
        return
    if kind is cst.FunctionDef:  # never inside an annotation or `__all__`, so in_strings is False here
        used |= _statement_names(node)
        return
    if kind is cst.Attribute:  # the attribute's own name is not a read of a global
        _collect_names(node.value, used, in_strings)
        return
    if kind is cst.SimpleString:
        if in_strings:
            value = node.evaluated_value
            if isinstance(value, str):
                used.update(_IDENTIFIER.findall(value))
        return
    # Identifiers inside string annotations and `__all__` entries count as reads.
    if kind is cst.Annotation or (
        kind is cst.Assign
        and any(isinstance(t.target, cst.Name) and t.target.value == "__all__" for t in node.targets)
    ):
        in_strings = True
    _collect_children(node, used, in_strings)


def _collect_children(node: cst.CSTNode, used: set[str], in_strings: bool) -> None:
    for name in _child_fields(type(node)):
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            _collect_names(value, used, in_strings)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, cst.CSTNode):
                    _collect_names(item, used, in_strings)


def _child_fields(kind: type) -> tuple[str, ...]:
    names = _CHILD_FIELDS.get(kind)
    if names is None:
        names = _CHILD_FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return names


def child_nodes(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The nodes directly under `node`, read from its fields (libcst's `children` rebuilds the node)."""
    found: list[cst.CSTNode] = []
    for name in _child_fields(type(node)):
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, cst.CSTNode))
    return found


def top_level_import_nodes(module: cst.Module) -> set[int]:
    """ids of Import/ImportFrom nodes that stand unguarded at module level."""
    return {
        id(small)
        for stmt in module.body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
        if isinstance(small, (cst.Import, cst.ImportFrom))
    }


def all_import_bindings(module: cst.Module) -> dict[str, str]:
    """Bindings of every module-level import, guarded blocks included (first binding wins)."""
    bound: dict[str, str] = {}
    for stmt in module_level_statements(module):
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    for name, target in import_bindings(small).items():
                        bound.setdefault(name, target)
    return bound
