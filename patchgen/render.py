"""jinja2 rendering of the generated file's header and patch markers (StrictUndefined: no silent gaps)."""

from __future__ import annotations

import functools

import jinja2


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("patchgen.templates", "."),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_header(**values) -> str:
    return _environment().get_template("header.py.j2").render(**values)


def render_marker(verb: str, reason: str) -> str:
    return _environment().get_template("marker.j2").render(verb=verb, reason=reason).strip()


def render_constants(device: str, op_defaults: list[tuple[str, str]]) -> str:
    return _environment().get_template("constants.py.j2").render(device=device, op_defaults=op_defaults)
