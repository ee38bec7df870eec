"""Upgrade report: what a new transformers release did to each patched upstream node.

For every target and patch: unchanged upstream, changed upstream (with the node's diff), missing
upstream (with the closest names), or signature changed (parameters, decorators), and whether the
override still accepts every argument upstream's signature takes.
"""

from __future__ import annotations

import dataclasses
import difflib

import libcst as cst

from patchgen.bodies import load_body
from patchgen.codemods.absolute_imports import AbsoluteImports
from patchgen.codemods.names import class_methods
from patchgen.codemods.rename import rename_tree
from patchgen.errors import PatchApplyError
from patchgen.pipeline import node_hash
from patchgen.source import UpstreamSource
from patchgen.spec import Patch, PatchConfig

UNCHANGED, CHANGED, SIGNATURE, MISSING, CONFLICT = (
    "unchanged", "changed", "signature changed", "missing", "conflict",
)


@dataclasses.dataclass
class PatchReport:
    target: str  # model/device
    verb: str
    name: str  # the patch target in the new upstream
    status: str
    details: str = ""
    diff: str = ""
    accepts_upstream_arguments: bool | None = None  # overrides only
    not_accepted: list[str] = dataclasses.field(default_factory=list)

    @property
    def needs_review(self) -> bool:
        return self.status != UNCHANGED or self.accepts_upstream_arguments is False

    def line(self) -> str:
        text = f"[{self.target}] {self.verb} {self.name}: {self.status}"
        text += "" if self.status == CONFLICT else " upstream"
        if self.details:
            text += f" ({self.details})"
        if self.accepts_upstream_arguments is True and self.status == SIGNATURE:
            text += "; the override accepts every upstream argument"
        elif self.accepts_upstream_arguments is False:
            text += f"; the override does not accept: {', '.join(self.not_accepted)}"
        return text


def _parse(upstream: UpstreamSource) -> cst.Module:
    return cst.parse_module(upstream.text).visit(AbsoluteImports(upstream.module))


def _find(module: cst.Module, qualname: str):
    head, _, method = qualname.partition(".")
    nodes = {s.name.value: s for s in module.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))}
    node = nodes.get(head)
    if method and isinstance(node, cst.ClassDef):
        return class_methods(node).get(method), nodes, node
    return (None if method else node), nodes, node


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "positional-only", "positional", "*args", "keyword-only", "**kwargs"
    has_default: bool

    @property
    def named(self) -> bool:
        return self.kind not in ("*args", "**kwargs")

    @property
    def positional(self) -> bool:
        return self.kind in ("positional-only", "positional")

    def __str__(self) -> str:
        return {"*args": "*", "**kwargs": "**"}.get(self.kind, "") + self.name


def parameters(function: cst.FunctionDef) -> list[Param]:
    """The signature, in order, with each parameter's kind and whether it has a default."""
    p = function.params
    found = [Param(x.name.value, "positional-only", x.default is not None) for x in p.posonly_params]
    found += [Param(x.name.value, "positional", x.default is not None) for x in p.params]
    if isinstance(p.star_arg, cst.Param):
        found.append(Param(p.star_arg.name.value, "*args", False))
    found += [Param(x.name.value, "keyword-only", x.default is not None) for x in p.kwonly_params]
    if p.star_kwarg is not None:
        found.append(Param(p.star_kwarg.name.value, "**kwargs", False))
    return found


def decorators(function: cst.FunctionDef) -> list[str]:
    return ["@" + cst.Module(body=[]).code_for_node(d.decorator) for d in function.decorators]


def _signature_delta(old: cst.FunctionDef, new: cst.FunctionDef) -> str:
    before, after = parameters(old), parameters(new)
    parts = []
    if before != after:
        old_names, new_names = {p.name: p for p in before}, {p.name: p for p in after}
        removed = [p for p in before if p.name not in new_names]
        added = [p for p in after if p.name not in old_names]
        renamed = []
        for gone in list(removed):
            index = before.index(gone)
            # A rename: same position, same kind, both named parameters.
            if index < len(after) and after[index] in added and after[index].kind == gone.kind and gone.named:
                renamed.append(f"{gone} -> {after[index]}")
                removed.remove(gone)
                added.remove(after[index])
        changes = [f"+{p}" for p in added] + [f"-{p}" for p in removed] + [f"renamed {r}" for r in renamed]
        for name in old_names.keys() & new_names.keys():
            a, b = old_names[name], new_names[name]
            if a.kind != b.kind:
                changes.append(f"{name}: {a.kind} -> {b.kind}")
            if a.has_default != b.has_default:
                changes.append(f"{name}: default {'removed' if a.has_default else 'added'}")
        kept_old = [p.name for p in before if p.name in new_names]
        kept_new = [p.name for p in after if p.name in old_names]
        if kept_old != kept_new:
            changes.append("reordered")
        parts.append("parameters: " + ", ".join(changes))
    d_before, d_after = decorators(old), decorators(new)
    if d_before != d_after:
        changes = [f"+{d}" for d in d_after if d not in d_before] + [f"-{d}" for d in d_before if d not in d_after]
        parts.append("decorators: " + ", ".join(changes or ["reordered"]))
    return "; ".join(parts)


def not_accepted(override: cst.FunctionDef, upstream: cst.FunctionDef) -> list[str]:
    """What a call matching upstream's signature may pass that the override would reject or misread."""
    mine, theirs = parameters(override), parameters(upstream)
    by_name = {p.name: p for p in mine if p.named}
    takes_args = any(p.kind == "*args" for p in mine)
    takes_kwargs = any(p.kind == "**kwargs" for p in mine)
    problems = []
    for param in theirs:
        if param.kind == "*args":
            if not takes_args:
                problems.append(str(param))
        elif param.kind == "**kwargs":
            if not takes_kwargs:
                problems.append(str(param))
        elif param.name not in by_name and not (takes_kwargs and param.kind != "positional-only"):
            problems.append(param.name)
        elif param.positional and param.name in by_name and not by_name[param.name].positional:
            problems.append(f"{param.name} (positional upstream, keyword-only here)")
    my_positional = [p.name for p in mine if p.positional]
    for index, param in enumerate(p for p in theirs if p.positional):
        if index < len(my_positional) and my_positional[index] != param.name and param.name in by_name:
            problems.append(f"{param.name} (position {index + 1} upstream, {my_positional.index(param.name) + 1} here)"
                            if param.name in my_positional else f"{param.name} (position {index + 1} upstream)")
    upstream_names = {p.name for p in theirs}
    problems += [f"requires {p.name}" for p in mine if p.named and not p.has_default and p.name not in upstream_names]
    return problems


def _node_diff(old_node, new_node, old: UpstreamSource, new: UpstreamSource, name: str) -> str:
    code = cst.Module(body=[]).code_for_node
    return "".join(
        difflib.unified_diff(
            code(old_node).splitlines(keepends=True),
            code(new_node).splitlines(keepends=True),
            fromfile=f"{name} (transformers {old.version})",
            tofile=f"{name} (transformers {new.version})",
        )
    )


def report_target(target_name: str, config: PatchConfig, old: UpstreamSource, new: UpstreamSource) -> list[PatchReport]:
    old_tree, new_tree = _parse(old), _parse(new)
    reports = []
    for patch in config.patches:
        if patch.verb == "add_import":
            continue
        name = config.resolved_target(patch)
        reports.append(_report_patch(target_name, config, patch, name, old_tree, new_tree, old, new))
    return reports


def _report_patch(target_name, config, patch: Patch, name, old_tree, new_tree, old, new) -> PatchReport:
    head, _, method = name.partition(".")
    old_node, _, _ = _find(old_tree, name)
    new_node, new_names, new_class = _find(new_tree, name)
    report = PatchReport(target_name, patch.verb, name, UNCHANGED)
    if patch.verb == "add_method":
        if new_class is None:
            return _missing(report, head, new_names)
        if new_node is not None:
            report.status, report.details = CONFLICT, f"upstream now defines {name}: use override_method"
        return report
    if new_node is None:
        if method and isinstance(new_class, cst.ClassDef):
            return _missing(report, method, class_methods(new_class), prefix=f"{head}.")
        return _missing(report, head, new_names)
    if old_node is None:
        raise PatchApplyError(f"{name} is not in the pinned transformers {old.version}: the config does not apply there")
    if node_hash(old_node) == node_hash(new_node):
        return report
    if type(old_node) is not type(new_node):
        kinds = {cst.ClassDef: "a class", cst.FunctionDef: "a function"}
        report.status, report.details = CHANGED, f"was {kinds[type(old_node)]}, now {kinds[type(new_node)]}"
        return report
    report.diff = _node_diff(old_node, new_node, old, new, name)
    report.status = CHANGED
    if isinstance(new_node, cst.FunctionDef):
        delta = _signature_delta(old_node, new_node)
        if delta:
            report.status, report.details = SIGNATURE, delta
        if patch.verb in ("override_method", "replace_function"):
            body = rename_tree(load_body(patch.body_module, patch.body_name, patch.kind).node, config.renames)
            report.not_accepted = not_accepted(body, new_node)
            report.accepts_upstream_arguments = not report.not_accepted
    return report


def _missing(report: PatchReport, name: str, candidates, prefix: str = "") -> PatchReport:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.5)
    report.status = MISSING
    report.details = "closest: " + ", ".join(prefix + c for c in close) if close else "no similar name"
    return report
