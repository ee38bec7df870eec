"""Relative imports -> absolute, so the generated module works from its own package."""

from __future__ import annotations

import libcst as cst

from patchgen.codemods.names import dotted_name, dotted_node


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

    def on_visit(self, node: cst.CSTNode) -> bool:
        # Imports are statements: no expression holds one, so expressions are not walked (nor rebuilt).
        if isinstance(node, cst.BaseExpression):
            return False
        return super().on_visit(node)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        if not updated.relative:
            return updated
        relative = dotted_name(updated.module) if updated.module is not None else None
        target = absolute_module(self.module, len(updated.relative), relative, self.is_package)
        return updated.with_changes(relative=[], module=dotted_node(target))
