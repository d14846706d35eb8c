"""Published generations in the data directory (``--data-dir``): a generation whose publish has
returned survives a clean restart and a kill -9, as a committed put does (store/persist.py).

Layout, under ``<data dir>/generations/``::

    <sha256(prefix) hex>/             one directory per prefix (a prefix is never used as a path)
        <number, 20 digits>/          one directory per generation kept
            generation.json           {"format", "prefix", "number", "digest" (hex), "names"}
            <sha256(name)>.safetensors   one file per tensor, as store/tensor_file.py has them
        .tmp-<uuid>/                  a generation being written, or one being removed

Crash safety: a generation is written into a ``.tmp-`` directory of its prefix (every file
fsynced, ``generation.json`` last, the directory fsynced), then renamed to its number and the
prefix directory fsynced: the rename is atomic, so after a crash a numbered directory is either
absent or complete. A removal renames the numbered directory to ``.tmp-`` first (atomic too), then
deletes it. Opening the directory deletes every ``.tmp-`` entry: a write that never finished, or
a removal that did.

A write whose publish is given up while it runs (its connection closed, the server stopping:
``Ticket.abandon``) is never renamed into place: it stops at the next file and its ``.tmp-``
directory goes. Had it been renamed already, ``abandon`` says so and the caller removes it. So a
generation whose publisher was told it failed does not come back at the next start.

What cannot be restored at start (a numbered directory that does not read back whole, a file
missing, a checksum that does not give the digest recorded, a link where tensorwire never makes
one, a prefix that nests with another's) is set aside, never silently dropped and never a reason
to stop every start: ``set_aside`` moves it under ``<data dir>/generations-quarantine/`` (named by
its prefix directory and number), where an operator can look at it or delete it; the server logs
it and counts it (STATUS ``generations.quarantined``).

Not thread-safe: its owner (store/generations.py) calls it from the store's one disk thread, or
before the server serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from tensorwire.errors import InvalidTensor, PersistenceError
from tensorwire.store.files import TEMP_PREFIX, refuse_link, sync_dir, write_durably
from tensorwire.store.tensor_file import check_item, encode_header, file_name, read_file
from tensorwire.types import Generation, TensorMeta

ROOT = "generations"
QUARANTINE = "generations-quarantine"  # beside ROOT: what could not be restored (module docstring)
MANIFEST = "generation.json"
FORMAT = 1
_NUMBER_DIGITS = 20


@dataclass(frozen=True, slots=True)
class StoredGeneration:
    """One generation as read back: its record and its tensors (bytes as 1-D uint8)."""

    prefix: str
    number: int
    digest: bytes
    tensors: list[tuple[TensorMeta, torch.Tensor]]
    path: pathlib.Path  # its directory (what ``set_aside`` moves if it cannot be restored)


# Hears of what the data directory holds that cannot be restored: its path and why.
SetAside = Callable[[pathlib.Path, Exception], None]


class Ticket:
    """Between one generation's write (on the disk thread) and its publish (on the loop): a publish
    given up before the write renamed the generation into place leaves nothing behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._abandoned = False
        self._installed = False

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def abandon(self) -> bool:
        """The publish is given up. True: too late, the generation is in place (remove it)."""
        with self._lock:
            self._abandoned = True
            return self._installed

    def install(self, rename: Callable[[], None]) -> None:
        """``rename`` the written generation into place unless its publish was given up
        (PersistenceError then: the write's ``.tmp-`` directory is removed)."""
        with self._lock:
            if self._abandoned:
                raise PersistenceError("its publish was given up during the write")
            rename()
            self._installed = True


def prefix_dir(prefix: str) -> str:
    return hashlib.sha256(prefix.encode("utf-8", "surrogatepass")).hexdigest()


def number_dir(number: int) -> str:
    return f"{number:0{_NUMBER_DIGITS}d}"


class GenerationDisk:
    """The generations of one data directory (module docstring)."""

    def __init__(self, data_dir: pathlib.Path) -> None:
        self.root = pathlib.Path(data_dir) / ROOT
        refuse_link(self.root)
        if not self.root.is_dir():
            try:
                self.root.mkdir()
            except OSError as exc:
                raise PersistenceError(f"cannot create {self.root}: {exc}") from exc
            sync_dir(self.root.parent)

    # -- writing -------------------------------------------------------------------------------
    def write(
        self, gen: Generation, tensors: Sequence[tuple[TensorMeta, memoryview]], ticket: Ticket | None = None
    ) -> None:
        """Make ``gen`` (``tensors``: its records, version = its number, and bytes) durable;
        PersistenceError (nothing left behind) if it cannot be, or if ``ticket`` is abandoned
        before it is in place. A directory of the same number already there (one a crash left
        between its rename and its removal) is replaced."""
        ticket = ticket or Ticket()
        for meta, data in tensors:
            try:
                check_item(meta, data)
            except InvalidTensor as exc:
                raise PersistenceError(f"generation {gen.number} of {gen.prefix!r}: {exc}") from exc
        home = self._prefix_home(gen.prefix)
        temp = home / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            _mkdir(temp)
            for meta, data in tensors:
                if ticket.abandoned:  # stop at once: nothing of it will be kept
                    raise PersistenceError("its publish was given up during the write")
                write_durably(temp / file_name(meta.name), (encode_header(meta), data))
            write_durably(temp / MANIFEST, (_manifest(gen),))
            sync_dir(temp)
            self._install(home, temp, number_dir(gen.number), ticket)
        except BaseException:
            _remove_tree(temp)
            raise

    def _prefix_home(self, prefix: str) -> pathlib.Path:
        home = self.root / prefix_dir(prefix)
        refuse_link(home)
        if not home.is_dir():
            _mkdir(home)
            sync_dir(self.root)
        return home

    def _install(self, home: pathlib.Path, temp: pathlib.Path, final: str, ticket: Ticket) -> None:
        target = home / final
        refuse_link(target)
        old = home / f"{TEMP_PREFIX}{uuid.uuid4().hex}" if target.exists() else None

        def rename() -> None:
            try:
                if old is not None:
                    os.replace(target, old)
                os.replace(temp, target)
            except OSError as exc:
                raise PersistenceError(f"cannot rename {temp} to {target}: {exc}") from exc

        ticket.install(rename)
        sync_dir(home)
        if old is not None:
            _remove_tree(old)

    # -- removing ------------------------------------------------------------------------------
    def remove(self, prefix: str, number: int) -> None:
        """Durably drop generation ``number`` of ``prefix`` (nothing if it is not there)."""
        home = self.root / prefix_dir(prefix)
        self._retire(home, home / number_dir(number))

    def remove_prefix(self, prefix: str) -> None:
        """Durably drop every generation of ``prefix``."""
        self._retire(self.root, self.root / prefix_dir(prefix))

    def _retire(self, parent: pathlib.Path, path: pathlib.Path) -> None:
        if not path.is_dir() or path.is_symlink():
            return
        trash = parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            os.replace(path, trash)
        except OSError as exc:
            raise PersistenceError(f"cannot remove {path}: {exc}") from exc
        sync_dir(parent)
        _remove_tree(trash)

    # -- reading back --------------------------------------------------------------------------
    def load(self, set_aside: SetAside) -> Iterator[StoredGeneration]:
        """Every generation kept, by prefix directory and, within one, oldest first; deletes what
        a crash left half-written (``.tmp-``) on the way, and hands what does not read back whole
        to ``set_aside`` (which moves it aside: ``quarantine``) instead of stopping there."""
        for home in self._entries(self.root, set_aside):
            numbers = self._entries(home, set_aside)
            for path in numbers:
                try:
                    stored = self._read(home, path)
                except PersistenceError as exc:
                    set_aside(path, exc)
                    continue
                yield stored
            with contextlib.suppress(OSError):  # fails unless empty: a prefix whose last generation
                home.rmdir()  # went (or was set aside)

    def _entries(self, directory: pathlib.Path, set_aside: SetAside) -> list[pathlib.Path]:
        """The sub-directories of ``directory`` in name order, its ``.tmp-`` ones deleted, a link
        (tensorwire never makes one: it would read another place) set aside."""
        try:
            names = sorted(os.listdir(directory))
        except OSError as exc:
            raise PersistenceError(f"cannot list {directory}: {exc}") from exc
        found = []
        for name in names:
            path = directory / name
            if name.startswith(TEMP_PREFIX):
                _remove_tree(path)
            elif path.is_symlink():
                set_aside(path, PersistenceError(f"{path} is a symbolic link; tensorwire never writes one"))
            elif path.is_dir():
                found.append(path)
        return found

    def quarantine(self, path: pathlib.Path) -> pathlib.Path:
        """Move ``path`` (a generation's directory, or a link in its place) under ``QUARANTINE``,
        durably; where it went. PersistenceError naming ``path`` if it cannot be moved (the
        server then does not start: an operator removes it)."""
        aside = self.root.parent / QUARANTINE
        target = aside / f"{path.parent.name[:16]}-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            refuse_link(aside)
            if not aside.is_dir():
                _mkdir(aside)
                sync_dir(aside.parent)
            os.replace(path, target)
            sync_dir(aside)
            sync_dir(path.parent)
        except (OSError, PersistenceError) as exc:
            raise PersistenceError(
                f"{path} cannot be restored and cannot be set aside ({exc}): move or remove it by hand"
            ) from exc
        return target

    def _read(self, home: pathlib.Path, path: pathlib.Path) -> StoredGeneration:
        record = _read_manifest(path / MANIFEST)
        prefix, number, digest, names = record
        if home.name != prefix_dir(prefix) or path.name != number_dir(number):
            raise PersistenceError(f"corrupt {path}: it holds generation {number} of {prefix!r}")
        tensors = []
        for name in names:
            file = path / file_name(name)
            refuse_link(file)
            meta, data = read_file(file)
            tensors.append((meta, data))
        return StoredGeneration(prefix, number, digest, tensors, path)


def _manifest(gen: Generation) -> bytes:
    body = {"format": FORMAT, "prefix": gen.prefix, "number": gen.number, "digest": gen.digest.hex(),
            "names": list(gen.names)}  # fmt: skip
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def _read_manifest(path: pathlib.Path) -> tuple[str, int, bytes, list[str]]:
    refuse_link(path)
    try:
        body = json.loads(path.read_bytes())
        prefix, number, digest, names = body["prefix"], body["number"], body["digest"], body["names"]
        ok = body["format"] == FORMAT and isinstance(prefix, str) and type(number) is int and number > 0
        if not ok or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("a field of the wrong kind")
        return prefix, number, bytes.fromhex(digest), names
    except OSError as exc:
        raise PersistenceError(f"cannot read {path}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise PersistenceError(f"corrupt {path}: {exc!r}") from exc


def _mkdir(path: pathlib.Path) -> None:
    try:
        path.mkdir()
    except OSError as exc:
        raise PersistenceError(f"cannot create {path}: {exc}") from exc


def _remove_tree(path: pathlib.Path) -> None:
    """Delete a ``.tmp-`` tree (best effort: what is left is deleted at the next start)."""
    with contextlib.suppress(OSError):
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path)
