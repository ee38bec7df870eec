"""One target, one pass: source -> codemods -> verify -> render. Pure: nothing here writes files."""

from __future__ import annotations

import builtins
import dataclasses
import difflib
import hashlib

import libcst as cst

import patchgen
from patchgen.bodies import load_body
from patchgen.codegen import module_code
from patchgen.codemods.absolute_imports import AbsoluteImports
from patchgen.codemods.definitions import ApplyDefinitionEdits, DefinitionEdits, MethodEdit
from patchgen.codemods.exports import DropFromAll
from patchgen.codemods.imports import DropUnusedImports, insert_imports
from patchgen.codemods.names import (
    all_import_bindings,
    class_methods,
    import_bindings,
    names_used,
    top_level_definitions,
)
from patchgen.codemods.rename import rename_tree
from patchgen.errors import PatchApplyError, PatchTargetMissing
from patchgen.render import render_constants, render_header, render_marker
from patchgen.signatures import keep_upstream_signature
from patchgen.source import UpstreamSource, load_upstream
from patchgen.spec import Patch, PatchConfig
from patchgen.targets import Target


@dataclasses.dataclass(frozen=True)
class Generated:
    target: Target
    python: str
    diff: str
    upstream: UpstreamSource
    upstream_hashes: dict[str, str]  # patch target -> short hash of the upstream node it edits


_NODE_HASHES: dict[int, tuple[cst.CSTNode, str]] = {}


def node_hash(node: cst.CSTNode) -> str:
    """Short hash of an upstream node's source, recorded per patch so upgrades show what moved."""
    cached = _NODE_HASHES.get(id(node))
    if cached is None or cached[0] is not node:
        digest = hashlib.sha256(cst.Module(body=[]).code_for_node(node).encode()).hexdigest()[:12]
        cached = _NODE_HASHES[id(node)] = (node, digest)
    return cached[1]


_PREPARED: dict[tuple[str, str], tuple[cst.Module, frozenset[str]]] = {}


def prepared_upstream(upstream: UpstreamSource) -> tuple[cst.Module, frozenset[str]]:
    """The upstream tree with absolute imports, and the names it reads: once per upstream text and process.

    libcst trees are immutable, so every target of one upstream module (gpu, npu) starts from the
    same tree, and the codemods keep its untouched statements as the same objects.
    """
    key = (upstream.module, upstream.sha256)
    if key not in _PREPARED:
        try:
            tree = cst.parse_module(upstream.text)
        except cst.ParserSyntaxError as exc:
            raise PatchApplyError(
                f"upstream {upstream.module} ({upstream.path}) does not parse: {exc}: "
                "reinstall transformers, or point --source at an intact copy"
            ) from None
        tree = tree.visit(AbsoluteImports(upstream.module))
        _PREPARED[key] = (tree, frozenset(names_used(tree)))
    return _PREPARED[key]


def generate(target: Target, config: PatchConfig | None = None, upstream: UpstreamSource | None = None) -> Generated:
    config = config or target.load_config()
    upstream = upstream or load_upstream(config.upstream_module)
    _, used_upstream = prepared_upstream(upstream)
    edited = edited_upstream(target, config, upstream)
    plan, tree = edited.plan, edited.tree

    constants = cst.parse_module(render_constants(target.device, sorted(config.op_defaults.items())))
    tree = insert_imports(tree, list(constants.body))
    tree = _carry_imports(tree, plan, config)
    defined = top_level_definitions(tree)
    unused = {n for n, kind in defined.items() if kind == "import" and n in used_upstream} - names_used(tree)
    tree = tree.visit(DropUnusedImports(unused))

    body = module_code(tree)
    output = f"generated/{target.model}/{target.output_name}.py"
    header = render_header(
        patchgen_version=patchgen.__version__,
        transformers_version=upstream.version,
        upstream_module=upstream.module,
        upstream_sha256=upstream.sha256,
        config_path=target.config_path,
        model=target.model,
        device=target.device,
        patches=[
            {"verb": p.verb, "target": config.resolved_target(p), "reason": p.reason,
             "upstream_hash": plan.hashes.get(config.resolved_target(p), "")}
            for p in config.patches
        ],
        op_defaults=sorted(config.op_defaults.items()),
    )
    python = header + body
    try:
        compile(python, output, "exec")
    except SyntaxError as exc:
        raise PatchApplyError(f"{target.name}: generated code does not compile: {exc}") from None
    if cst.parse_module(header).body:
        raise PatchApplyError(f"{target.name}: the rendered header holds code, not only comments (check patch reasons)")
    upstream_name = upstream.module.replace(".", "/") + ".py"
    diff = "".join(
        difflib.unified_diff(
            upstream.text.splitlines(keepends=True),
            python.splitlines(keepends=True),
            fromfile=f"a/{upstream_name}",
            tofile=f"b/{output}",
        )
    )
    return Generated(target, python, diff, upstream, plan.hashes)


@dataclasses.dataclass
class _Plan:
    edits: DefinitionEdits
    imports: dict[str, tuple[cst.Import | cst.ImportFrom, str]]  # bound name -> (statement, body source)
    unresolved: dict[str, str]  # name -> body source that reads it
    extra: list[cst.SimpleStatementLine]
    expected: dict[tuple, Patch]
    hashes: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Edited:
    """The upstream tree with one patch list applied, and the plan it came from (imports still to carry)."""

    tree: cst.Module
    plan: _Plan


_EDITED: dict[tuple, Edited] = {}


def edited_upstream(target: Target, config: PatchConfig, upstream: UpstreamSource) -> Edited:
    """Plan, apply and verify the config's patches: once per upstream text, patch list and rename map.

    The device targets of one model declare the same patches (they differ in op-slot defaults, which
    only the constants block and the header show), so the second device reuses the first one's tree,
    whose statements stay the same objects: the per-statement caches (names read, rendered text) hit.
    Errors are raised, never cached, so each target reports its own.
    """
    renames = config.renames
    key = (
        upstream.module,
        upstream.sha256,
        tuple(config.patches),
        tuple(renames.prefixes.items()),  # in order: the first matching prefix wins
        tuple(renames.modules.items()),
        tuple(renames.names.items()),
    )
    if key not in _EDITED:
        tree, _ = prepared_upstream(upstream)
        plan = _plan_edits(target, config, upstream, tree)
        tree = tree.visit(ApplyDefinitionEdits(plan.edits))
        if plan.edits.exclude:
            tree = tree.visit(DropFromAll(set(plan.edits.exclude)))
            still_read = sorted(set(plan.edits.exclude) & names_used(tree))
            if still_read:
                raise PatchApplyError(
                    f"{target.name}: excluded {', '.join(still_read)} still read by code that remains "
                    f"(transformers {upstream.version}): exclude or replace the code that uses it too"
                )
        _verify_applied(plan, config, upstream)
        _EDITED[key] = Edited(tree, plan)
    return _EDITED[key]


def _plan_edits(target: Target, config: PatchConfig, upstream: UpstreamSource, tree: cst.Module) -> _Plan:
    defined = top_level_definitions(tree)
    nodes = {s.name.value: s for s in tree.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))}
    plan = _Plan(DefinitionEdits(), {}, {}, [], {}, {})
    for patch in config.patches:
        name = config.resolved_target(patch)
        if patch.verb == "add_import":
            plan.extra.append(cst.parse_statement(patch.statement))
            continue
        head, _, method = name.partition(".")
        node = _check_target(patch, name, head, method, defined, nodes, config, upstream)
        plan.hashes[name] = node_hash(node)
        marker = render_marker(patch.verb, patch.reason)
        if patch.verb == "exclude":
            plan.edits.exclude[head] = marker
            plan.expected[("exclude", head)] = patch
            continue
        body = load_body(patch.body_module, patch.body_name, patch.kind)
        renamed = rename_tree(body.node, config.renames)
        # An explicit body= may be named freely; it takes the target's name in the generated module.
        renamed = renamed.with_changes(name=cst.Name(method or head))
        renamed = _keep_signatures(patch, name, node, renamed, body.source, upstream)
        for bound, statement in body.imports.items():
            name, renamed_statement = config.renames.identifier(bound), rename_tree(statement, config.renames)
            if name in plan.imports:
                first, first_source = plan.imports[name]
                if import_bindings(first)[name] != import_bindings(renamed_statement)[name]:
                    raise PatchApplyError(
                        f"bodies {first_source} and {body.source} import {name!r} from different places "
                        f"({import_bindings(first)[name]} and {import_bindings(renamed_statement)[name]}): "
                        "one generated module has one binding per name; rename one of the imports"
                    )
                continue
            plan.imports[name] = (renamed_statement, body.source)
        for bound in body.unresolved:
            plan.unresolved.setdefault(config.renames.identifier(bound), body.source)
        if method:
            plan.edits.methods.setdefault(head, {})[method] = MethodEdit(
                renamed, marker, keep_upstream_decorators=patch.decorators == "upstream", add=patch.verb == "add_method"
            )
            plan.expected[("method", head, method)] = patch
        else:
            plan.edits.replace[head] = (renamed, marker)
            plan.expected[("replace", head)] = patch
    return plan


def _keep_signatures(patch, name, upstream_node, body_node, source, upstream):
    """Overrides and replacements keep upstream's parameters and annotations (patchgen/signatures.py)."""
    where = f"{patch.verb} {name} (body {source}, declared at {patch.declared_at}, transformers {upstream.version})"
    if patch.verb in ("override_method", "replace_function"):
        return keep_upstream_signature(upstream_node, body_node, where)
    if patch.verb != "replace_class":
        return body_node
    upstream_methods = class_methods(upstream_node)
    statements = [
        keep_upstream_signature(upstream_methods[s.name.value], s, f"{where}, method {s.name.value}")
        if isinstance(s, cst.FunctionDef) and s.name.value in upstream_methods
        else s
        for s in body_node.body.body
    ]
    return body_node.with_changes(body=body_node.body.with_changes(body=statements))


def _check_target(patch, name, head, method, defined, nodes, config, upstream):
    where = f"declared at {patch.declared_at}, upstream {upstream.module} in transformers {upstream.version}"
    if head not in nodes:
        close = difflib.get_close_matches(head, list(nodes), n=3)
        hint = f"; closest upstream names: {', '.join(close)}" if close else ""
        raise PatchTargetMissing(f"{patch.verb} {name}: {head!r} is not defined upstream ({where}){hint}")
    node = nodes[head]
    want_class = patch.verb in ("replace_class", "override_method", "add_method")
    if want_class and not isinstance(node, cst.ClassDef):
        raise PatchTargetMissing(f"{patch.verb} {name}: upstream {head!r} is a function, not a class ({where})")
    if patch.verb == "replace_function" and not isinstance(node, cst.FunctionDef):
        raise PatchTargetMissing(f"{patch.verb} {name}: upstream {head!r} is a class, not a function ({where})")
    if not method:
        return node
    methods = class_methods(node)
    if patch.verb == "override_method" and method not in methods:
        close = difflib.get_close_matches(method, list(methods), n=3)
        hint = f"closest methods of {head} upstream: {', '.join(close)}; " if close else ""
        raise PatchTargetMissing(
            f"override_method {name}: class {head} has no method {method!r} upstream ({where}); "
            f"{hint}use add_method to add one"
        )
    if patch.verb == "add_method" and method in methods:
        raise PatchTargetMissing(
            f"add_method {name}: class {head} already has {method!r} upstream ({where}); use override_method"
        )
    return methods.get(method, node)


def _verify_applied(plan: _Plan, config: PatchConfig, upstream: UpstreamSource) -> None:
    for key, patch in plan.expected.items():
        count = plan.edits.applied[key]
        if count != 1:
            raise PatchApplyError(
                f"{patch.verb} {config.resolved_target(patch)} applied {count} times, expected exactly once "
                f"(declared at {patch.declared_at}, transformers {upstream.version})"
            )


def _carry_imports(tree: cst.Module, plan: _Plan, config: PatchConfig) -> cst.Module:
    defined = top_level_definitions(tree)
    bindings = all_import_bindings(tree)
    upstream_module = config.upstream_module
    upstream_package = upstream_module.rpartition(".")[0]

    def clash(name: str, wanted: str, source: str) -> PatchApplyError:
        have = bindings.get(name) or f"its own {defined[name]} {name}"
        return PatchApplyError(
            f"{source} imports {name!r} as {wanted}, but the upstream module binds {name!r} to {have}: "
            f"import it under another name (e.g. `... import {wanted.rpartition('.')[2]} as my_{name}`)"
        )

    for statement in plan.extra:
        for name, wanted in import_bindings(statement.body[0]).items():
            if name in defined and bindings.get(name) != wanted:
                raise clash(name, wanted, f"add_import {cst.Module(body=[]).code_for_node(statement).strip()!r}")
    added: dict[str, cst.Import | cst.ImportFrom] = {}
    for name in sorted(plan.imports):
        statement, source = plan.imports[name]
        wanted = import_bindings(statement)[name]
        if wanted == upstream_module:
            raise PatchApplyError(
                f"body {source} reads the upstream module object {name!r}: import the names it needs from "
                f"{upstream_module} instead (the generated module is that module)"
            )
        from_upstream = wanted.startswith(upstream_module + ".")
        if name in defined:
            if from_upstream or bindings.get(name) == wanted:
                continue  # the generated module already binds this very name
            raise clash(name, wanted, f"body {source}")
        if from_upstream or wanted.startswith(upstream_package + "."):
            excluded = name in plan.edits.exclude
            raise PatchApplyError(
                f"body {source} imports {name!r} from the upstream model package ({wanted}), which "
                + ("a declared exclude removes: keep it or adapt the body" if excluded else
                   "this upstream does not define: adapt the body to this transformers release, or check the "
                   f"rename map of {config.model}/{config.device}")
            )
        added[name] = statement
    for name, source in sorted(plan.unresolved.items()):
        if name not in defined and name not in added and not hasattr(builtins, name):
            raise PatchApplyError(
                f"body {source} reads {name!r}, which neither the upstream module nor the bodies module's imports "
                "define: import it in the bodies module"
            )
    return insert_imports(tree, list(plan.extra) + _grouped(added.values()))


def _grouped(statements) -> list[cst.SimpleStatementLine]:
    """One `from m import a, b` line per module, plain imports first, sorted: stable, readable output."""
    plain: dict[str, cst.Import] = {}
    by_module: dict[str, list[cst.ImportAlias]] = {}
    for statement in statements:
        code = cst.Module(body=[]).code_for_node(statement)
        if isinstance(statement, cst.Import):
            plain[code] = statement
        else:
            module = code.split(" import ", 1)[0][len("from "):]
            by_module.setdefault(module, []).extend(statement.names)
    lines = [cst.SimpleStatementLine(body=[plain[key]]) for key in sorted(plain)]
    for module in sorted(by_module):
        aliases = sorted(by_module[module], key=lambda a: cst.Module(body=[]).code_for_node(a.name))
        aliases = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in aliases]
        lines.append(cst.SimpleStatementLine(body=[cst.ImportFrom(module=cst.parse_expression(module), names=aliases)]))
    return lines
