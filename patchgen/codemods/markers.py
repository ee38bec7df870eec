"""Patch markers: a comment above every patched node naming the verb and the reason."""

from __future__ import annotations

import libcst as cst


def with_marker(node: cst.ClassDef | cst.FunctionDef, text: str) -> cst.ClassDef | cst.FunctionDef:
    """Prepend one marker comment line to the node's leading lines (kept after any blank lines)."""
    blanks = [line for line in node.leading_lines if line.comment is None]
    comments = [line for line in node.leading_lines if line.comment is not None]
    marker = cst.EmptyLine(comment=cst.Comment(text))
    return node.with_changes(leading_lines=[*blanks, *comments, marker])
