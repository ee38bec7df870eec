"""Imports: carry in what the bodies need, drop top-level imports that the patches made unused.

Guarded imports (`try:` / `if is_x_available():` blocks) are never hoisted or edited.
"""

from __future__ import annotations

import libcst as cst

from patchgen.codemods.names import import_bindings


def insert_imports(module: cst.Module, statements: list[cst.SimpleStatementLine]) -> cst.Module:
    """Insert statements after the last top-level import line of the module's leading import block."""
    if not statements:
        return module
    body = list(module.body)
    last = -1
    for index, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body):
            last = index
        elif isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            break
    first, *rest = statements
    first = first.with_changes(leading_lines=[cst.EmptyLine(), *first.leading_lines])
    return module.with_changes(body=[*body[: last + 1], first, *rest, *body[last + 1 :]])


class DropUnusedImports(cst.CSTTransformer):
    """Removes aliases of top-level imports whose names are in `unused` (and empty statements)."""

    def __init__(self, unused: set[str]):
        self.unused = unused
        self.depth = 0
        self.dropped: list[str] = []

    def _enter(self, node):
        self.depth += 1
        return False  # nothing inside a definition or a guarded block is edited: do not rebuild it

    def _leave(self, original, updated):
        self.depth -= 1
        return updated

    visit_ClassDef = visit_FunctionDef = visit_If = visit_Try = _enter
    leave_ClassDef = leave_FunctionDef = leave_If = leave_Try = _leave

    def leave_SimpleStatementLine(self, original, updated):
        if self.depth:
            return updated
        kept_small = []
        for small in updated.body:
            if isinstance(small, (cst.Import, cst.ImportFrom)) and not (
                isinstance(small, cst.ImportFrom) and isinstance(small.names, cst.ImportStar)
            ):
                aliases = [a for a in small.names if _bound_name(a, small) not in self.unused]
                self.dropped += [_bound_name(a, small) for a in small.names if _bound_name(a, small) in self.unused]
                if not aliases:
                    continue
                if len(aliases) < len(small.names):
                    aliases[-1] = aliases[-1].with_changes(comma=small.names[-1].comma)
                    small = small.with_changes(names=aliases)
            kept_small.append(small)
        if not kept_small:
            return cst.RemovalSentinel.REMOVE
        return updated.with_changes(body=kept_small)


def _bound_name(alias: cst.ImportAlias, statement) -> str:
    single = statement.with_changes(names=[alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)])
    return next(iter(import_bindings(single)))
