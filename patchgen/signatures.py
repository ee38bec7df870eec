"""An override keeps upstream's signature: every parameter, in order, of the same kind, with its annotation.

transformers reads the signatures of model forwards (which keyword arguments a model accepts, whether
`**kwargs` is `Unpack[TransformersKwargs]`), so an override that drops a parameter or an annotation
changes behaviour silently. The generator writes upstream's annotation on a body parameter left bare
(one body serves sibling models whose upstream annotations differ) and refuses a body that drops a
parameter, changes its kind or order, or annotates it otherwise. A body may add parameters, and
annotate what upstream left bare.
"""

from __future__ import annotations

import libcst as cst

from patchgen.errors import SignatureMismatch

_EMPTY = cst.Module(body=[])


def _code(node: cst.CSTNode | None) -> str | None:
    return None if node is None else " ".join(_EMPTY.code_for_node(node).split())


def _params(fn: cst.FunctionDef) -> list[tuple[str, str, str | None]]:
    """(kind, name, annotation) per parameter, without the leading self / cls."""
    p = fn.params
    rows = [("positional", x.name.value, _code(x.annotation and x.annotation.annotation)) for x in (*p.posonly_params, *p.params)]
    if isinstance(p.star_arg, cst.Param):
        rows.append(("*args", p.star_arg.name.value, _code(p.star_arg.annotation and p.star_arg.annotation.annotation)))
    rows += [("keyword-only", x.name.value, _code(x.annotation and x.annotation.annotation)) for x in p.kwonly_params]
    if p.star_kwarg is not None:
        rows.append(("**kwargs", p.star_kwarg.name.value, _code(p.star_kwarg.annotation and p.star_kwarg.annotation.annotation)))
    if rows and rows[0][0] == "positional" and rows[0][1] in ("self", "cls"):
        rows = rows[1:]
    return rows


def keep_upstream_signature(upstream: cst.FunctionDef, body: cst.FunctionDef, what: str) -> cst.FunctionDef:
    """``body`` with upstream's annotations on its bare parameters; SignatureMismatch if it drops or
    changes upstream's parameters or annotations. ``what`` names the patch, its body and where it was declared."""
    ours = {name: (kind, annotation) for kind, name, annotation in _params(body)}
    positional = [name for kind, name, _ in _params(body) if kind == "positional"]
    upstream_positional = [name for kind, name, _ in _params(upstream) if kind == "positional"]
    for kind, name, annotation in _params(upstream):
        shown = f"{name}: {annotation}" if annotation else name
        if name not in ours:
            raise SignatureMismatch(f"{what}: drops upstream's parameter `{shown}` ({kind}); add it back to the body")
        if ours[name][0] != kind:
            raise SignatureMismatch(
                f"{what}: upstream's parameter `{name}` is {kind}, the body makes it {ours[name][0]}; keep its kind"
            )
        if annotation is not None and ours[name][1] not in (None, annotation):
            raise SignatureMismatch(
                f"{what}: parameter `{name}` is annotated `{annotation}` upstream, the body has `{ours[name][1]}`; "
                f"write `{shown}` or leave it bare (transformers reads these annotations)"
            )
    if positional[: len(upstream_positional)] != upstream_positional:
        raise SignatureMismatch(
            f"{what}: positional parameters ({', '.join(positional)}) do not start with upstream's "
            f"({', '.join(upstream_positional)}) in order; positional callers would pass the wrong values"
        )
    return body.with_changes(params=body.params.visit(_Annotate(_annotations(upstream))))


def _annotations(fn: cst.FunctionDef) -> dict[str, cst.Annotation]:
    p = fn.params
    every = [*p.posonly_params, *p.params, *p.kwonly_params]
    every += [x for x in (p.star_arg, p.star_kwarg) if isinstance(x, cst.Param)]
    return {x.name.value: x.annotation for x in every if x.annotation is not None}


class _Annotate(cst.CSTTransformer):
    """Gives each bare parameter upstream's annotation of the same name."""

    def __init__(self, annotations: dict[str, cst.Annotation]):
        self.annotations = annotations

    def leave_Param(self, original: cst.Param, updated: cst.Param) -> cst.Param:
        if updated.annotation is None and updated.name.value in self.annotations:
            spaced = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(" "), whitespace_after=cst.SimpleWhitespace(" "))
            return updated.with_changes(
                annotation=self.annotations[updated.name.value],
                equal=spaced if updated.default is not None else updated.equal,
            )
        return updated
