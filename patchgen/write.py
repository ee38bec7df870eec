"""Atomic writes: a temp file in the destination folder, then rename. Unchanged files are not touched.

A rewritten file keeps its permission bits; a new file gets the process umask's default (as `open`
would give it), not mkstemp's private 0600. The temp file's name is `.<name>.<random>.tmp`, which
`check.stray_temp_files` looks for after a write that was killed before its rename.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from patchgen.errors import OutputError

TEMP_PREFIX, TEMP_SUFFIX = ".", ".tmp"


def check_writable(path: Path) -> None:
    """OutputError if ``path`` cannot be written for a reason visible before writing: a folder in its place,
    or a file where one of its folders should be. Run over every path of a run before the first write, so
    that such a run writes nothing rather than some targets."""
    if path.is_dir():
        raise OutputError(f"cannot write {path}: a folder is in its place: remove or rename that folder")
    for folder in path.parents:
        if folder.exists():
            if not folder.is_dir():
                raise OutputError(
                    f"cannot write {path}: {folder} is a file, not a folder: "
                    "remove it, or point PATCHGEN_OUTPUT_DIR at a folder"
                )
            return


def write_if_changed(path: Path, text: str) -> bool:
    """Write text to path atomically; return whether the file changed."""
    data = text.encode("utf-8")
    existing_mode = None
    try:
        if path.exists():
            check_writable(path)
            if path.read_bytes() == data:
                return False
            existing_mode = stat.S_IMODE(path.stat().st_mode)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    except (NotADirectoryError, FileExistsError) as exc:
        raise OutputError(
            f"cannot write {path}: {exc.filename or path.parent} is a file, not a folder: "
            "remove it, or point PATCHGEN_OUTPUT_DIR at a folder"
        ) from None
    except PermissionError as exc:
        raise OutputError(
            f"cannot write {path}: permission denied on {exc.filename or path.parent}: "
            "make the folder writable, or point PATCHGEN_OUTPUT_DIR at a writable folder"
        ) from None
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}: check the disk and the folder") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, existing_mode if existing_mode is not None else 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OutputError(f"cannot write {path}: {exc.strerror or exc}: check the disk and the folder") from None
        raise
    return True


def current_umask() -> int:
    """The process umask (read by setting it and putting it back: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
