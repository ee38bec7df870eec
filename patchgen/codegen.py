"""A module's source text from its libcst tree, each top-level statement rendered once per process."""

from __future__ import annotations

import libcst as cst

# (id(statement), indent, newline) -> (statement, text). The device targets of one model share the
# statements of their edited tree, so the second target renders only what differs (constants, imports).
_STATEMENT_CODE: dict[tuple[int, str, str], tuple[cst.CSTNode, str]] = {}


def module_code(module: cst.Module) -> str:
    """Exactly `module.code`: header, statements and footer, each top-level statement's text cached.

    A top-level statement renders the same whatever surrounds it (no enclosing indent), so its text
    can be reused by every module that holds that very statement object.
    """
    if not module.has_trailing_newline or not module.body:
        return module.code  # libcst trims the last newline, or writes one for an empty module: rare
    return "".join(
        [module.code_for_node(line) for line in module.header]
        + [_statement_code(module, statement) for statement in module.body]
        + [module.code_for_node(line) for line in module.footer]
    )


def _statement_code(module: cst.Module, statement: cst.CSTNode) -> str:
    key = (id(statement), module.default_indent, module.default_newline)
    cached = _STATEMENT_CODE.get(key)
    if cached is None or cached[0] is not statement:
        cached = _STATEMENT_CODE[key] = (statement, module.code_for_node(statement))
    return cached[1]
