"""Keeps `__all__` in step with exclusions."""

from __future__ import annotations

import libcst as cst


class DropFromAll(cst.CSTTransformer):
    def __init__(self, names: set[str]):
        self.names = names

    def visit_ClassDef(self, node):
        return False  # `__all__` is a module-level assignment: definitions are left as they are

    def visit_FunctionDef(self, node):
        return False

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
        if not (len(updated.targets) == 1 and isinstance(updated.targets[0].target, cst.Name)
                and updated.targets[0].target.value == "__all__" and isinstance(updated.value, (cst.List, cst.Tuple))):
            return updated
        kept = [
            element for element in updated.value.elements
            if not (isinstance(element.value, cst.SimpleString) and element.value.evaluated_value in self.names)
        ]
        if kept and len(kept) < len(updated.value.elements):
            # The last element keeps its trailing comma style of the original last element.
            kept[-1] = kept[-1].with_changes(comma=updated.value.elements[-1].comma)
        return updated.with_changes(value=updated.value.with_changes(elements=kept))
