"""Writing files where a user pointed us, without following what someone else planted there.

The CLI writes into paths and directories a user names (``get -o``, ``dataset fetch --out``,
``certs DIR``, ``serve --ready-file``), and ``dataset fetch`` writes under ``--out`` at relative
paths a *server* chose. Another local user (or the server, through earlier files) may have planted
symlinks, FIFOs or directories there. The rules here:

* the directory the user named is taken as given (a symlink they chose is theirs to choose);
* below it, every component is opened with ``O_NOFOLLOW`` relative to its parent's descriptor
  (``dir_fd``), so a symlink planted under it is never followed, and a peer's path is checked to be
  plain components (no ``..``, no ``.``, nothing empty, nothing absolute) before any of it is used;
* a file is written to a fresh temporary name (``O_CREAT | O_EXCL | O_NOFOLLOW``: never an existing
  file or link), flushed to disk, then renamed over the target: a symlink at the target is replaced,
  never written through, and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from tensorwire.errors import InvalidName
from tensorwire.wire.names import validate_name

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
Writer = Callable[[BinaryIO], object]  # fills the new file (its result is ignored)


def relative_parts(path: object, where: str) -> list[str]:
    """The components of ``path``, a relative file path a peer sent; InvalidName (naming ``where``)
    unless it is a non-empty string of plain components: no "", ".", ".." or absolute paths."""
    if not isinstance(path, str):
        raise InvalidName(f"{where}: a path must be a string, not {type(path).__name__}")
    try:
        validate_name(path, max_bytes=4096)
    except InvalidName as exc:
        raise InvalidName(f"{where}: {path[:200]!r} is not a relative path under it ({exc})") from None
    return path.split("/")


def _tmp_name(name: str) -> str:
    return f".{name[:100]}.tmp-{secrets.token_hex(6)}"


def _write_new(dir_fd: int, name: str, write: Writer, mode: int) -> None:
    """Create ``name`` (it must not exist: not even as a dangling link) in ``dir_fd`` and fill it."""
    fd = os.open(name, _NEW_FLAGS, mode, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # whatever the umask: a key file is 0600 from its first byte
        write(f)
        f.flush()
        os.fsync(f.fileno())


def replace_in(dir_fd: int, name: str, write: Writer, mode: int = 0o644) -> None:
    """Write ``name`` in the directory ``dir_fd`` atomically: a fresh temporary file, then a rename
    over whatever ``name`` was (a symlink there is replaced, not followed)."""
    tmp = _tmp_name(name)
    try:
        _write_new(dir_fd, tmp, write, mode)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


@contextlib.contextmanager
def opened_dir(path: Path, create: bool = False) -> Iterator[int]:
    """A descriptor of the directory ``path`` (made first with ``create``), closed on exit."""
    if create:
        path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def write_file(path: Path, write: Writer, mode: int = 0o644) -> None:
    """Write the file ``path`` a user named, atomically (``replace_in`` its directory)."""
    with opened_dir(path.parent if str(path.parent) else Path(".")) as fd:
        replace_in(fd, path.name, write, mode)


def create_file(path: Path, write: Writer, mode: int = 0o644) -> None:
    """Create the file ``path``, which must not exist yet (FileExistsError, also for a link)."""
    with opened_dir(path.parent if str(path.parent) else Path(".")) as fd:
        _write_new(fd, path.name, write, mode)


class SafeDir:
    """A directory the user named, under which a peer's relative paths are written and read
    without ever following a symlink below it (see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _parent(self, parts: list[str], create: bool) -> Iterator[int | None]:
        """The descriptor of the directory holding ``parts[-1]`` (None if it does not exist and
        ``create`` is false); each component opened with O_NOFOLLOW from the one above it."""
        fds: list[int] = []
        fd = self._fd
        try:
            for part in parts[:-1]:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if create:
                        raise
                    yield None
                    return
                except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file
                    why = f"{part!r} under {self.root} is not a plain directory ({exc.strerror})"
                    raise InvalidName(f"{'/'.join(parts)}: {why}: refusing to follow it") from exc
                fds.append(fd)
            yield fd
        finally:
            for opened in fds:
                os.close(opened)

    def write(self, parts: list[str], data: bytes | memoryview, mode: int = 0o644) -> None:
        """Write ``data`` to the file at ``parts`` (from ``relative_parts``) atomically, making
        the directories above it."""
        with self._parent(parts, create=True) as fd:
            assert fd is not None
            replace_in(fd, parts[-1], lambda f: f.write(data), mode)

    def read_regular(self, parts: list[str]) -> bytes | None:
        """The bytes of the regular file at ``parts``; None if there is none (a missing file, a
        symlink, a FIFO or a device is never opened for reading: it is simply not "there")."""
        with self._parent(parts, create=False) as fd:
            if fd is None:
                return None
            try:
                handle = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                 dir_fd=fd)  # fmt: skip
            except OSError:
                return None
            with os.fdopen(handle, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    return None
                return f.read()

    def size_of(self, parts: list[str]) -> int | None:
        """The size of the regular file at ``parts`` (None: no regular file there), via lstat."""
        with self._parent(parts, create=False) as fd:
            if fd is None:
                return None
            try:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            except OSError:
                return None
            return st.st_size if stat.S_ISREG(st.st_mode) else None
