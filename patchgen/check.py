"""The drift gate: regenerate in memory, compare with the files on disk, never write."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from patchgen.errors import OrphanedFile
from patchgen.pipeline import Generated
from patchgen.targets import Target, generated_dir


@dataclasses.dataclass(frozen=True)
class Drift:
    path: Path
    diff: str  # unified diff from the file on disk to what generation produces


def expected_files(result: Generated, with_diff: bool = True) -> dict[Path, str]:
    files = {result.target.output_path(): result.python}
    if with_diff:
        files[result.target.diff_path()] = result.diff
    return files


def compare(result: Generated) -> list[Drift]:
    drifts = []
    for path, want in expected_files(result).items():
        # Bytes, not read_text: newline translation would hide a CRLF file on disk.
        have = path.read_bytes().decode("utf-8", errors="replace") if path.exists() else ""
        if have != want:
            label = path.relative_to(generated_dir().parent) if path.is_relative_to(generated_dir().parent) else path
            diff = "".join(
                difflib.unified_diff(
                    have.splitlines(keepends=True),
                    want.splitlines(keepends=True),
                    fromfile=f"{label} (on disk{'' if path.exists() else ': missing'})",
                    tofile=f"{label} (generated)",
                )
            )
            drifts.append(Drift(path, diff))
    return drifts


def orphans(targets: list[Target]) -> list[Path]:
    """Generated-looking files that no configured target produces."""
    owned = {p for t in targets for p in (t.output_path(), t.diff_path())}
    found = []
    for path in sorted(generated_dir().glob("*/patched_modeling_*")):
        if path.suffix in (".py", ".diff") and path not in owned:
            found.append(path)
    return found


def check_orphans(targets: list[Target]) -> None:
    stray = orphans(targets)
    if stray:
        names = ", ".join(str(p) for p in stray)
        raise OrphanedFile(f"orphaned generated file(s) with no config: {names}: delete them, or add the config")
