"""Helpers on dotted names and top-level definitions of a libcst module."""

from __future__ import annotations

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


def names_used(node: cst.CSTNode) -> set[str]:
    """Every name read under node: Name nodes (not attribute names), and identifiers inside string
    annotations and `__all__` entries. Import statements are excluded."""
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
