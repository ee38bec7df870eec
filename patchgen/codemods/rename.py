"""Renames identifiers in a tree (never text): reuses one model's bodies on a sibling model."""

from __future__ import annotations

import libcst as cst

from patchgen.codemods.names import child_nodes, dotted_name, dotted_node
from patchgen.spec import Renames


class RenameIdentifiers(cst.CSTTransformer):
    """Each Name node renamed once by prefix; import module paths renamed by component."""

    def __init__(self, renames: Renames, on_path: set[int]):
        self.renames = renames
        self.on_path = on_path

    def on_visit(self, node: cst.CSTNode) -> bool:
        # Only the nodes on the way to a name or an import that changes are walked, and so rebuilt (a
        # transformer rebuilds every node it walks); the nodes beside the way stay the same objects.
        return id(node) in self.on_path and super().on_visit(node)

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        renamed = self.renames.identifier(updated.value)
        return updated if renamed == updated.value else updated.with_changes(value=renamed)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        # `obj.Name` is an attribute of another object, not a module-level identifier of ours.
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        # A keyword argument names the callee's parameter, which the rename does not touch.
        return updated.with_changes(keyword=original.keyword)

    def leave_Import(self, original: cst.Import, updated: cst.Import) -> cst.Import:
        # `import a.b.c [as x]` names modules: renamed by path component, never by identifier prefix.
        names = [
            new.with_changes(name=dotted_node(self.renames.module(dotted_name(old.name))))
            for old, new in zip(original.names, updated.names)
        ]
        return updated.with_changes(names=names)

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        if original.module is None:
            return updated
        # Module paths are named by the original dotted path; Name renames above must not touch them.
        return updated.with_changes(module=dotted_node(self.renames.module(dotted_name(original.module))))


def rename_tree(node: cst.CSTNode, renames: Renames) -> cst.CSTNode:
    if not renames:
        return node
    on_path = _paths_to_changes(node, renames)
    return node.visit(RenameIdentifiers(renames, on_path)) if id(node) in on_path else node


def _paths_to_changes(root: cst.CSTNode, renames: Renames) -> set[int]:
    """ids of every Name the renames change, every import (its module path may change), and their ancestors."""
    on_path: set[int] = set()

    def walk(node: cst.CSTNode) -> bool:
        kind = type(node)
        if kind is cst.Name:
            changes = renames.identifier(node.value) != node.value
        else:
            changes = kind is cst.Import or kind is cst.ImportFrom
            for child in child_nodes(node):
                changes = walk(child) or changes
        if changes:
            on_path.add(id(node))
        return changes

    walk(root)
    return on_path
