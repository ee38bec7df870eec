"""Top-level edits: replace a class or function, drop an excluded one, override or add methods."""

from __future__ import annotations

import dataclasses
from collections import Counter

import libcst as cst

from patchgen.codemods.markers import with_marker


@dataclasses.dataclass
class MethodEdit:
    body: cst.FunctionDef
    marker: str
    keep_upstream_decorators: bool
    add: bool  # add_method (must not exist) vs override_method (must exist)


@dataclasses.dataclass
class DefinitionEdits:
    """What to do to each top-level name; applied counts are recorded for verification."""

    replace: dict[str, tuple[cst.ClassDef | cst.FunctionDef, str]] = dataclasses.field(default_factory=dict)
    exclude: dict[str, str] = dataclasses.field(default_factory=dict)
    methods: dict[str, dict[str, MethodEdit]] = dataclasses.field(default_factory=dict)
    applied: Counter = dataclasses.field(default_factory=Counter)


class ApplyDefinitionEdits(cst.CSTTransformer):
    """One pass over module-level statements; nested classes and functions are never touched."""

    def __init__(self, edits: DefinitionEdits):
        self.edits = edits
        self.depth = 0

    # Returning False keeps the children as they are (the same objects): nothing nested is edited,
    # and an untouched definition is neither rebuilt nor re-read by names_used (its cache hits).
    def visit_ClassDef(self, node):
        self.depth += 1
        return False

    def visit_FunctionDef(self, node):
        self.depth += 1
        return False

    def visit_SimpleStatementLine(self, node):
        return False  # no definition inside: keep the line as it is

    def leave_FunctionDef(self, original, updated):
        self.depth -= 1
        return self._top_level(original, updated) if self.depth == 0 else updated

    def leave_ClassDef(self, original, updated):
        self.depth -= 1
        if self.depth != 0:
            return updated
        result = self._top_level(original, updated)
        name = original.name.value
        if name in self.edits.methods and isinstance(result, cst.ClassDef) and name not in self.edits.replace:
            result = self._edit_methods(name, result)
        return result

    def _top_level(self, original, updated):
        name = original.name.value
        if name in self.edits.exclude:
            self.edits.applied[("exclude", name)] += 1
            return cst.RemovalSentinel.REMOVE
        if name in self.edits.replace:
            body, marker = self.edits.replace[name]
            self.edits.applied[("replace", name)] += 1
            return with_marker(body.with_changes(leading_lines=updated.leading_lines), marker)
        return updated

    def _edit_methods(self, class_name: str, cls: cst.ClassDef) -> cst.ClassDef:
        wanted = self.edits.methods[class_name]
        statements = []
        for stmt in cls.body.body:
            edit = wanted.get(stmt.name.value) if isinstance(stmt, cst.FunctionDef) else None
            if edit is None or edit.add:
                statements.append(stmt)
                continue
            self.edits.applied[("method", class_name, stmt.name.value)] += 1
            new = edit.body.with_changes(leading_lines=stmt.leading_lines)
            if edit.keep_upstream_decorators:
                new = new.with_changes(decorators=stmt.decorators)
            statements.append(with_marker(new, edit.marker))
        for name, edit in wanted.items():
            if edit.add:
                self.edits.applied[("method", class_name, name)] += 1
                new = edit.body.with_changes(leading_lines=[cst.EmptyLine()])
                statements.append(with_marker(new, edit.marker))
        return cls.with_changes(body=cls.body.with_changes(body=statements))
