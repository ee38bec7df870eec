"""Helpers on dotted names and top-level definitions of a libcst module."""

from __future__ import annotations

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


def top_level_definitions(module: cst.Module) -> dict[str, str]:
    """Names bound at module level -> kind ("class", "function", "import", "assign"), guarded blocks included."""
    found: dict[str, str] = {}

    def visit(statements):
        for stmt in statements:
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
            elif isinstance(stmt, cst.If):
                visit(stmt.body.body)
                if stmt.orelse is not None:
                    visit(stmt.orelse.body.body if isinstance(stmt.orelse, cst.Else) else [stmt.orelse])
            elif isinstance(stmt, cst.Try):
                visit(stmt.body.body)
                for handler in stmt.handlers:
                    visit(handler.body.body)

    visit(module.body)
    return found


def class_methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    return {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}


def names_used(node: cst.CSTNode) -> set[str]:
    """Every Name read anywhere under node, import statements excluded."""
    used: set[str] = set()

    class Collector(cst.CSTVisitor):
        def visit_Import(self, _):
            return False

        def visit_ImportFrom(self, _):
            return False

        def visit_Name(self, name: cst.Name):
            used.add(name.value)

    node.visit(Collector())
    return used
