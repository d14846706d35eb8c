"""Durable file operations in a directory tensorwire owns (a data directory, its generations):
a file is written under a temp name and fsynced, renamed over its final name (atomic), and the
directory fsynced, so that a final name always holds a complete file that survives a crash.
Files are opened without following symbolic links: tensorwire never makes one, and one planted
there would be read or written through, into a file elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import uuid
from collections.abc import Sequence

from tensorwire.errors import PersistenceError

TEMP_PREFIX = ".tmp-"
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def new_temp(directory: pathlib.Path) -> pathlib.Path:
    """A fresh temp name in ``directory`` (``.tmp-<uuid>``)."""
    return directory / f"{TEMP_PREFIX}{uuid.uuid4().hex}"


def rename(directory: pathlib.Path, temp: str, final: str) -> None:
    """Rename ``temp`` over ``final`` (both in ``directory``), atomically; PersistenceError if not."""
    src, dst = directory / temp, directory / final
    try:
        os.replace(src, dst)
    except OSError as exc:
        raise PersistenceError(f"cannot rename {src} to {dst}: {exc}") from exc


def unlink_quietly(path: pathlib.Path) -> None:
    """Best-effort removal while already handling another failure, which is the one to report."""
    with contextlib.suppress(OSError):
        path.unlink()


def write_durably(path: pathlib.Path, chunks: Sequence[bytes | memoryview]) -> None:
    """Create ``path`` holding ``chunks`` and fsync it; on failure, remove what was written."""
    try:
        # "x" (O_CREAT | O_EXCL) never follows a symbolic link: a link planted under this
        # name makes the open fail instead of writing through it.
        with open(path, "xb") as f:
            for chunk in chunks:
                f.write(chunk)  # a memoryview goes straight to the file, without a copy
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        unlink_quietly(path)
        raise PersistenceError(f"cannot write {path}: {exc}") from exc


def sync_dir(path: pathlib.Path) -> None:
    """fsync a directory, which makes the creations, renames and deletions in it durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise PersistenceError(f"cannot fsync directory {path}: {exc}") from exc


def refuse_link(path: pathlib.Path) -> None:
    """tensorwire never makes a symbolic link in a data directory; one there would be read (or
    written) through, into a file elsewhere, so it is refused."""
    if path.is_symlink():
        raise PersistenceError(f"{path} is a symbolic link; tensorwire never writes one")
