"""The patch DSL: what a config declares about one (model, device) target.

A config module builds one `PatchConfig` named `config`. Replacement bodies live in an ordinary,
importable Python module (the *bodies module*: torch and friends allowed, unit-testable); the
generator never imports it, it reads the bodies' source. A body is found by the same qualified
name as its target (`Qwen3_5Attention.forward` -> class `Qwen3_5Attention`, method `forward` of
the bodies module), or by an explicit `body="module:Qual.name"`.

    config = PatchConfig("qwen3_5", "gpu", bodies="patchgen.configs.qwen3_5.bodies")
    config.override_method("Qwen3_5Attention.forward", reason="varlen attention through ops.attention")
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping

from patchgen.errors import ConfigError

VERBS = ("replace_class", "replace_function", "override_method", "add_method", "add_import", "exclude")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_QUALNAME = re.compile(rf"^{_IDENT}(\.{_IDENT})?$")
_BODY_REF = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})?$")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One declared edit. `target` is `Name` or `Class.method` in the upstream module (after renames)."""

    verb: str
    target: str
    reason: str
    body_module: str | None  # bodies module the replacement is read from; None for exclude/add_import
    body_name: str | None  # qualified name inside body_module
    declared_at: str  # "config file:line", for error messages
    decorators: str = "upstream"  # override_method: keep "upstream" decorators, or take the "body"'s
    statement: str | None = None  # add_import: the import statement

    @property
    def kind(self) -> str:
        """What the target is upstream: "class", "function" or "method" (None for imports)."""
        return {
            "replace_class": "class",
            "replace_function": "function",
            "override_method": "method",
            "add_method": "method",
            "add_import": "import",
        }.get(self.verb, "class or function")


@dataclasses.dataclass(frozen=True)
class Renames:
    """Reuse of one model's patches on a sibling model, applied to identifier nodes only.

    `prefixes` maps an identifier prefix to its replacement (`Qwen3_5` -> `Qwen3_5Moe`); an identifier
    that already starts with the replacement is left alone, so `Qwen3_5MoeMoe` never happens.
    `modules` maps dotted module path components (`qwen3_5` -> `qwen3_5_moe`) in imports, and `names`
    whole identifiers that differ between siblings (`BaseModelOutputWithPast` -> `MoeModelOutputWithPast`).
    """

    prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    modules: Mapping[str, str] = dataclasses.field(default_factory=dict)
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)  # exact identifiers, before prefixes

    def identifier(self, name: str) -> str:
        if name in self.names:
            return self.names[name]
        for old, new in self.prefixes.items():
            if name.startswith(old) and not name.startswith(new):
                return new + name[len(old):]
        return name

    def qualname(self, qualname: str) -> str:
        return ".".join(self.identifier(part) for part in qualname.split("."))

    def module(self, dotted: str) -> str:
        return ".".join(self.modules.get(part, part) for part in dotted.split("."))

    def __bool__(self) -> bool:
        return bool(self.prefixes or self.modules or self.names)


class PatchConfig:
    """The declared patches of one target, plus its op-slot defaults."""

    def __init__(
        self,
        model: str,
        device: str,
        *,
        bodies: str | None = None,
        upstream_module: str | None = None,
        op_defaults: Mapping[str, str] | None = None,
        renames: Renames | None = None,
    ):
        self.model = model
        self.device = device
        self.bodies = bodies
        self.upstream_module = upstream_module or f"transformers.models.{model}.modeling_{model}"
        self.op_defaults = dict(op_defaults or {})
        self.renames = renames or Renames()
        self.patches: list[Patch] = []
        self._inherited: set[int] = set()  # ids of patches copied from a parent config by derive()

    # -- verbs -------------------------------------------------------------------------------
    def replace_class(self, target: str, *, reason: str, body: str | None = None) -> Patch:
        """Replace an upstream class by the bodies module's class of the same name."""
        return self._add("replace_class", target, reason, body, want_dots=0)

    def replace_function(self, target: str, *, reason: str, body: str | None = None) -> Patch:
        """Replace an upstream top-level function."""
        return self._add("replace_function", target, reason, body, want_dots=0)

    def override_method(
        self, target: str, *, reason: str, body: str | None = None, decorators: str = "upstream"
    ) -> Patch:
        """Replace one method of an upstream class; upstream's decorators are kept unless decorators="body"."""
        if decorators not in ("upstream", "body"):
            raise ConfigError(f"override_method({target!r}): decorators must be 'upstream' or 'body', got {decorators!r}")
        return self._add("override_method", target, reason, body, want_dots=1, decorators=decorators)

    def add_method(self, target: str, *, reason: str, body: str | None = None) -> Patch:
        """Add a method that upstream's class does not have (an existing one needs override_method)."""
        return self._add("add_method", target, reason, body, want_dots=1)

    def add_import(self, statement: str, *, reason: str) -> Patch:
        """Add an import statement that no body references by name (bodies' own imports are carried in)."""
        statement = statement.strip()
        if not _one_import_line(statement):
            raise ConfigError(f"add_import: expected one 'import ...' or 'from ... import ...' line, got {statement!r}")
        self._check_reason(statement, reason)
        patch = Patch("add_import", statement, reason, None, None, _caller(), statement=statement)
        self.patches.append(patch)
        return patch

    def exclude(self, target: str, *, reason: str) -> Patch:
        """Drop an upstream class or function (and its `__all__` entry) from the generated module."""
        return self._add("exclude", target, reason, None, want_dots=0, needs_body=False)

    # -- derived configs ---------------------------------------------------------------------
    def derive(
        self,
        *,
        model: str | None = None,
        device: str | None = None,
        renames: Renames | None = None,
        op_defaults: Mapping[str, str] | None = None,
        upstream_module: str | None = None,
        bodies: str | None = None,
    ) -> PatchConfig:
        """A sibling target carrying these patches: another device (op defaults) or model (renames)."""
        renames = renames or Renames()
        model = model or self.model
        child = PatchConfig(
            model,
            device or self.device,
            bodies=bodies or self.bodies,
            upstream_module=upstream_module or (None if model != self.model else self.upstream_module),
            op_defaults={**self.op_defaults, **(op_defaults or {})},
            renames=Renames(
                {**self.renames.prefixes, **renames.prefixes},
                {**self.renames.modules, **renames.modules},
                {**self.renames.names, **renames.names},
            ),
        )
        child.patches = list(self.patches)
        child._inherited = {id(p) for p in child.patches}
        return child

    def resolved_target(self, patch: Patch) -> str:
        """The patch's target in this config's upstream module (renames applied)."""
        return patch.target if patch.verb == "add_import" else self.renames.qualname(patch.target)

    # -- internals ---------------------------------------------------------------------------
    def _add(self, verb, target, reason, body, *, want_dots, decorators="upstream", needs_body=True) -> Patch:
        if not isinstance(target, str) or not _QUALNAME.match(target) or target.count(".") != want_dots:
            shape = "Class.method" if want_dots else "Name"
            raise ConfigError(f"{verb}({target!r}): target must look like {shape}")
        self._check_reason(target, reason)
        body_module = body_name = None
        if needs_body:
            if body is None:
                if not self.bodies:
                    raise ConfigError(f"{verb}({target!r}): no body= given and the config declares no bodies module")
                body_module, body_name = self.bodies, target
            elif _BODY_REF.match(body):
                body_module, body_name = body.split(":")
            else:
                raise ConfigError(f"{verb}({target!r}): body must be 'package.module:Qual.name', got {body!r}")
        patch = Patch(verb, target, reason, body_module, body_name, _caller(), decorators=decorators)
        resolved = self.renames.qualname(target)
        for index, existing in enumerate(self.patches):
            if existing.verb == "add_import" or self.renames.qualname(existing.target) != resolved:
                continue
            if id(existing) in self._inherited:
                # A derived config supersedes an inherited patch in place (e.g. an MoE body of its own).
                self.patches[index] = patch
                return patch
            raise ConfigError(
                f"{verb}({target!r}) at {patch.declared_at}: target already patched by {existing.verb} "
                f"at {existing.declared_at}"
            )
        self.patches.append(patch)
        return patch

    @staticmethod
    def _check_reason(target: str, reason: str) -> None:
        if not isinstance(reason, str) or not reason.strip() or not reason.isprintable():
            raise ConfigError(f"patch {target!r}: reason must be one non-empty line (it is printed in the generated file)")


def _one_import_line(statement: str) -> bool:
    import libcst as cst  # the DSL validates with the generator's own parser

    if "\n" in statement or not statement.isprintable():
        return False
    try:
        parsed = cst.parse_statement(statement)
    except cst.ParserSyntaxError:
        return False
    return (
        isinstance(parsed, cst.SimpleStatementLine)
        and len(parsed.body) == 1
        and isinstance(parsed.body[0], (cst.Import, cst.ImportFrom))
        and not (isinstance(parsed.body[0], cst.ImportFrom) and parsed.body[0].relative)
    )


def _caller() -> str:
    """file:line of the config statement that declared a patch."""
    # sys._getframe, not inspect.stack(): the latter reads every frame's source lines (~50 ms a call).
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename != __file__:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"
