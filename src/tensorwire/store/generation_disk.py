"""Published generations in the data directory (``--data-dir``): a generation whose publish has
returned survives a clean restart and a kill -9, as a committed put does (store/persist.py).

Layout, under ``<data dir>/generations/``::

    <sha256(prefix) hex>/             one directory per prefix (a prefix is never used as a path)
        <number, 20 digits>/          one directory per generation kept
            generation.json           {"format", "prefix", "number", "digest" (hex), "names"}
            <sha256(name)>.safetensors   one file per tensor, as store/persist.py writes them
        .tmp-<uuid>/                  a generation being written, or one being removed

Crash safety: a generation is written into a ``.tmp-`` directory of its prefix (every file
fsynced, ``generation.json`` last, the directory fsynced), then renamed to its number and the
prefix directory fsynced: the rename is atomic, so after a crash a numbered directory is either
absent or complete. A removal renames the numbered directory to ``.tmp-`` first (atomic too), then
deletes it. Opening the directory deletes every ``.tmp-`` entry: a write that never finished, or
a removal that did. A numbered directory that does not read back whole (a file missing, a
checksum that does not give the digest recorded) is a ``PersistenceError`` at start, as a corrupt
tensor file is: never a silent loss.

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
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tensorwire.errors import InvalidTensor, PersistenceError
from tensorwire.store.persist import (
    TEMP_PREFIX,
    check_item,
    encode_header,
    file_name,
    read_file,
    refuse_link,
    sync_dir,
    write_durably,
)
from tensorwire.types import Generation, TensorMeta

ROOT = "generations"
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
    def write(self, gen: Generation, tensors: Sequence[tuple[TensorMeta, memoryview]]) -> None:
        """Make ``gen`` (``tensors``: its records, version = its number, and bytes) durable;
        PersistenceError (nothing left behind) if it cannot be. A directory of the same number
        already there (a write whose publish was cancelled) is replaced."""
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
                write_durably(temp / file_name(meta.name), (encode_header(meta), data))
            write_durably(temp / MANIFEST, (_manifest(gen),))
            sync_dir(temp)
            self._install(home, temp, number_dir(gen.number))
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

    def _install(self, home: pathlib.Path, temp: pathlib.Path, final: str) -> None:
        target = home / final
        refuse_link(target)
        old = home / f"{TEMP_PREFIX}{uuid.uuid4().hex}" if target.exists() else None
        try:
            if old is not None:
                os.replace(target, old)
            os.replace(temp, target)
        except OSError as exc:
            raise PersistenceError(f"cannot rename {temp} to {target}: {exc}") from exc
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
    def load(self) -> Iterator[StoredGeneration]:
        """Every generation kept, by prefix directory and, within one, oldest first; deletes what
        a crash left half-written (``.tmp-``) on the way."""
        for home in self._entries(self.root):
            numbers = self._entries(home)
            for path in numbers:
                yield self._read(home, path)
            if not numbers:
                with contextlib.suppress(OSError):
                    home.rmdir()  # a prefix whose last generation went

    def _entries(self, directory: pathlib.Path) -> list[pathlib.Path]:
        """The sub-directories of ``directory`` in name order, its ``.tmp-`` ones deleted."""
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
                raise PersistenceError(f"{path} is a symbolic link; tensorwire never writes one")
            elif path.is_dir():
                found.append(path)
        return found

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
        return StoredGeneration(prefix, number, digest, tensors)


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
