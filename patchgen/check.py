"""The drift gate: regenerate in memory, compare with the files on disk, never write."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from patchgen.errors import OrphanedFile, OutputError, StrayTempFile
from patchgen.pipeline import Generated
from patchgen.targets import Target, generated_dir
from patchgen.write import TEMP_PREFIX, TEMP_SUFFIX


@dataclasses.dataclass(frozen=True)
class Drift:
    path: Path
    diff: str  # unified diff from the file on disk to what generation produces


def expected_files(result: Generated, with_diff: bool = True) -> dict[Path, str]:
    files = {result.target.output_path(): result.python}
    if with_diff:
        files[result.target.diff_path()] = result.diff
    return files


def check_output_folder(targets: list[Target]) -> None:
    """The output folder and each model folder are folders (or absent), and no output path is a folder.

    Without this, a file in the folder's place reads as "every generated file missing": drift, exit 1.
    """
    root = generated_dir()
    folders = [root] + sorted({t.output_path().parent for t in targets})
    for folder in folders:
        if folder.exists() and not folder.is_dir():
            raise OutputError(
                f"output folder {folder} is a file, not a folder: remove or rename it "
                "(or point PATCHGEN_OUTPUT_DIR at a folder)"
            )
    for target in targets:
        for path in (target.output_path(), target.diff_path()):
            if path.is_dir():
                raise OutputError(f"{path} is a folder, where a generated file belongs: remove or rename it")


def compare(result: Generated) -> list[Drift]:
    drifts = []
    for path, want in expected_files(result).items():
        # Bytes, not read_text: newline translation would hide a CRLF file on disk.
        try:
            have = path.read_bytes().decode("utf-8", errors="replace") if path.exists() else ""
        except OSError as exc:
            raise OutputError(f"cannot read {path}: {exc.strerror or exc}: check its permissions") from None
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
    if not generated_dir().is_dir():
        return found
    for path in sorted(generated_dir().glob("*/patched_modeling_*")):
        if path.suffix in (".py", ".diff") and path not in owned:
            found.append(path)
    return found


def check_orphans(targets: list[Target]) -> None:
    stray = orphans(targets)
    if stray:
        names = ", ".join(str(p) for p in stray)
        raise OrphanedFile(f"orphaned generated file(s) with no config: {names}: delete them, or add the config")
    leftovers = stray_temp_files()
    if leftovers:
        names = ", ".join(str(p) for p in leftovers)
        raise StrayTempFile(
            f"temporary file(s) left by an interrupted write: {names}: delete them "
            "(the generated files next to them were either fully written or left as they were)"
        )


def stray_temp_files() -> list[Path]:
    """Temp files of `write.write_if_changed` whose rename never happened (the writer was killed)."""
    root = generated_dir()
    if not root.is_dir():
        return []
    return sorted(root.glob(f"*/{TEMP_PREFIX}patched_modeling_*{TEMP_SUFFIX}"))
