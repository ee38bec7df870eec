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


def parameters(function: cst.FunctionDef) -> list[str]:
    """Parameter names with their kind marks: `x`, `*args`, `**kwargs`, keyword-only as `k=`-less names."""
    p = function.params
    names = [param.name.value for param in (*p.posonly_params, *p.params)]
    if isinstance(p.star_arg, cst.Param):
        names.append("*" + p.star_arg.name.value)
    names += [param.name.value for param in p.kwonly_params]
    if p.star_kwarg is not None:
        names.append("**" + p.star_kwarg.name.value)
    return names


def decorators(function: cst.FunctionDef) -> list[str]:
    return ["@" + cst.Module(body=[]).code_for_node(d.decorator) for d in function.decorators]


def _signature_delta(old: cst.FunctionDef, new: cst.FunctionDef) -> str:
    before, after = parameters(old), parameters(new)
    parts = []
    if before != after:
        removed = [n for n in before if n not in after]
        added = [n for n in after if n not in before]
        renamed = []
        for r in list(removed):
            if r in before and before.index(r) < len(after) and after[before.index(r)] in added:
                new_name = after[before.index(r)]
                renamed.append(f"{r} -> {new_name}")
                removed.remove(r)
                added.remove(new_name)
        changes = [f"+{n}" for n in added] + [f"-{n}" for n in removed] + [f"renamed {r}" for r in renamed]
        if not changes:
            changes = ["reordered"]
        parts.append("parameters: " + ", ".join(changes))
    d_before, d_after = decorators(old), decorators(new)
    if d_before != d_after:
        changes = [f"+{d}" for d in d_after if d not in d_before] + [f"-{d}" for d in d_before if d not in d_after]
        parts.append("decorators: " + ", ".join(changes or ["reordered"]))
    return "; ".join(parts)


def not_accepted(override: cst.FunctionDef, upstream: cst.FunctionDef) -> list[str]:
    """Upstream parameters that a call matching upstream's signature could pass and the override rejects."""
    mine = parameters(override)
    takes_kwargs = any(n.startswith("**") for n in mine)
    takes_args = any(n.startswith("*") and not n.startswith("**") for n in mine)
    plain = {n for n in mine if not n.startswith("*")}
    missing = []
    for name in parameters(upstream):
        if name.startswith("**"):
            if not takes_kwargs:
                missing.append(name)
        elif name.startswith("*"):
            if not takes_args:
                missing.append(name)
        elif name not in plain and not takes_kwargs:
            missing.append(name)
    return missing


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
