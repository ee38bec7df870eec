"""Relative imports -> absolute, so the generated module works from its own package."""

from __future__ import annotations

import libcst as cst

from patchgen.codemods.names import child_nodes, dotted_name, dotted_node


def absolute_module(module: str, level: int, relative: str | None, is_package: bool = False) -> str:
    """`from ..x import y` inside `module` -> the absolute dotted path of `..x`."""
    package = module if is_package else module.rpartition(".")[0]
    parts = package.split(".")
    if level - 1 > len(parts) - 1:
        raise ValueError(f"relative import of level {level} escapes package {package}")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([relative] if relative else []))


class AbsoluteImports(cst.CSTTransformer):
    def __init__(self, module: str, is_package: bool = False):
        self.module = module
        self.is_package = is_package  # a package's __init__: `.x` is inside the package itself
        self.on_path: set[int] = set()

    def on_visit(self, node: cst.CSTNode) -> bool:
        # Only the nodes on the way to a relative import are walked, and so rebuilt: the rest of the
        # tree stays the same objects (a transformer rebuilds every node it walks; a 2,000-line
        # upstream module has a few dozen relative imports, most of them at its top).
        if isinstance(node, cst.Module):
            self.on_path = relative_import_paths(node)
        return id(node) in self.on_path and super().on_visit(node)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        if not updated.relative:
            return updated
        relative = dotted_name(updated.module) if updated.module is not None else None
        target = absolute_module(self.module, len(updated.relative), relative, self.is_package)
        return updated.with_changes(relative=[], module=dotted_node(target))


def relative_import_paths(module: cst.Module) -> set[int]:
    """ids of every relative `from . import` and of the nodes that enclose it."""
    on_path: set[int] = set()

    def walk(node: cst.CSTNode, enclosing: tuple[int, ...]) -> None:
        if isinstance(node, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            # An import is one of a line's small statements, never nested deeper.
            found = [id(small) for small in node.body if isinstance(small, cst.ImportFrom) and small.relative]
            if found:
                on_path.update(enclosing, found, (id(node),))
        elif not isinstance(node, cst.BaseExpression):  # no expression holds a statement
            for child in child_nodes(node):
                walk(child, (*enclosing, id(node)))

    walk(module, ())
    return on_path
