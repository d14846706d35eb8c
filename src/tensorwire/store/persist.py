"""Durable, crash-safe storage of a tensor store in a data directory.

Layout
------
One file per key, ``<sha256(name as UTF-8) hex>.safetensors``: names may hold ``/`` and any unicode,
so a name is never used as a path. Each file is a valid safetensors file (8-byte little-endian
header length, JSON header padded with spaces to a multiple of 8 bytes, raw data) holding exactly
one tensor under its real name. ``__metadata__`` records ``tensorwire.version``,
``tensorwire.dtype`` (torch dtype name) and ``tensorwire.shape`` (JSON list). Dtypes safetensors
knows are written with their real dtype and shape, so ``safetensors.torch.load_file`` returns the
right tensor; the others (complex32, complex128, float8 fnuz/e8m0, float4, bits*) are written as
``U8`` of shape ``[nbytes]`` and restored from the metadata. Bytes are written as they are in
memory, which is the safetensors (little-endian) layout on every platform torch ships for.

Besides those files the directory may hold ``.tmp-<uuid>`` (a file being written),
``journal-<uuid>.json`` (a batch being committed), ``revision.slots`` (the last version handed
out; see "Deletes on a full disk") and ``generations/`` (published generations: written and read
by store/generation_disk.py, with this module's file helpers); anything else is ignored. A stored
tensor's file that is a symbolic link is refused at start: tensorwire never makes one, and it
would read another file.

Crash safety
------------
* Every file is written under a temp name, flushed and fsynced before it is renamed over its final
  name, and the directory is fsynced after the rename: a final name therefore always holds a
  complete file, old or new (rename is atomic), and survives a crash once ``write`` returns.
* A single item needs nothing more. A batch of several needs all-or-none across files, which
  renames alone cannot give, so: all temps are fsynced, then a journal listing the temp->final
  renames is made durable (temp + fsync + rename + directory fsync), then the renames run, the
  directory is fsynced and the journal deleted.
* Opening a directory replays any journal: its existence proves every temp it names is complete, and
  a temp that is already gone was already renamed, so the replay is idempotent (a crash during the
  replay is replayed again). Temps no journal names belong to a batch that never committed and are
  deleted: a crash before the journal is durable leaves every old value in place.
* The journal's deletion is not fsynced: should it reappear after a crash, its temps are all gone
  (their renames were fsynced first), so replaying it changes nothing.
* If a rename fails mid-batch in a live process, the journal is kept and remembered; every later
  ``write``/``remove`` first completes it, so a stale journal can never be replayed over a newer
  value. At most one journal exists at a time.

Deletes on a full disk
----------------------
A delete must first make the last version handed out durable (else a restart could hand out a
deleted version again), and it must work when the disk is full, since deleting is how space is
freed. So that version lives in ``revision.slots``, a file of one block written once when the
directory is opened and overwritten in place afterwards, which takes no new disk space. It holds
two slots, each ``u64 revision | u32 crc32`` at its own 512-byte sector; a save overwrites the slot
holding the smaller revision and fsyncs, so a torn write leaves the other slot, and the files not
yet removed, to bound the versions from below. A directory written before this file existed has
a text file ``revision``, still read. Files are opened without following symbolic links.

A ``DataDir`` is not thread-safe; its owner serializes calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import struct
import uuid
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import safetensors
import safetensors.torch
import torch

from tensorwire.errors import InvalidTensor, PersistenceError
from tensorwire.logs import event
from tensorwire.types import TensorMeta
from tensorwire.wire.dtypes import dtype_from_name, dtype_name

SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
JOURNAL_PREFIX = "journal-"
REVISION_FILE = "revision"  # the text file of data directories written before revision.slots
SLOTS_FILE = "revision.slots"
_SLOT = struct.Struct("<QI")  # revision, crc32 of its 8 bytes
_SLOT_OFFSETS = (0, 512)  # one sector each: a torn write damages at most one
_SLOTS_BYTES = 4096  # one block, allocated when the file is made
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

log = logging.getLogger("tensorwire.store")
JOURNAL_SUFFIX = ".json"
META_VERSION = "tensorwire.version"
META_DTYPE = "tensorwire.dtype"
META_SHAPE = "tensorwire.shape"

# torch dtype name -> safetensors dtype code, for the dtypes written with their real dtype. The fnuz
# float8s are left out on purpose: older safetensors releases cannot read them.
_SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "complex64": "C64",
}


def _native_codes() -> dict[torch.dtype, str]:
    """The dtypes this torch has and the installed safetensors can load, with their codes."""
    # A code the installed safetensors cannot load falls back to U8, so our own files always reload.
    known: dict[str, Any] | None = getattr(safetensors.torch, "_TYPES", None)
    codes: dict[torch.dtype, str] = {}
    for torch_name, code in _SAFETENSORS_CODES.items():
        dtype = getattr(torch, torch_name, None)
        if isinstance(dtype, torch.dtype) and (known is None or known.get(code) == dtype):
            codes[dtype] = code
    return codes


_NATIVE_CODES = _native_codes()


def file_name(name: str) -> str:
    """The file (in the data directory) that holds the tensor called ``name``."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PersistenceError(f"tensor name {name!r} is not valid unicode: {exc}") from exc
    return hashlib.sha256(encoded).hexdigest() + SUFFIX


def encode_header(meta: TensorMeta) -> bytes:
    """The safetensors prefix (length + padded JSON header) of the file for ``meta``."""
    code = _NATIVE_CODES.get(meta.dtype)
    st_dtype, st_shape = (code, list(meta.shape)) if code else ("U8", [meta.nbytes])
    header = {
        "__metadata__": {
            META_VERSION: str(meta.version),
            META_DTYPE: dtype_name(meta.dtype),
            META_SHAPE: json.dumps(list(meta.shape)),
        },
        meta.name: {"dtype": st_dtype, "shape": st_shape, "data_offsets": [0, meta.nbytes]},
    }
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the spec allows trailing spaces; 8-alignment keeps data aligned
    return struct.pack("<Q", len(raw)) + raw


def check_item(meta: TensorMeta, data: memoryview) -> None:
    """Refuse, before anything touches the disk, an item that could not be read back as given."""
    if meta.name == "__metadata__":
        raise InvalidTensor("a tensor called '__metadata__' cannot be stored in a safetensors file")
    dtype_from_name(dtype_name(meta.dtype))  # raises InvalidTensor for dtypes load() would refuse
    meta.check_size()
    if data.nbytes != meta.nbytes or not data.c_contiguous:
        raise InvalidTensor(
            f"{meta.name!r}: expected {meta.nbytes} contiguous bytes, got {data.nbytes} "
            f"(contiguous={data.c_contiguous})"
        )
    if meta.version < 0:
        raise InvalidTensor(f"{meta.name!r}: negative version {meta.version}")


def _unlink_quietly(path: pathlib.Path) -> None:
    """Best-effort removal while already handling another failure, which is the one to report."""
    with contextlib.suppress(OSError):
        path.unlink()


class DataDir:
    """A directory of safetensors files, one per tensor; see the module docstring."""

    def __init__(self, path: pathlib.Path) -> None:
        self._path = pathlib.Path(path)
        self._pending_journal: pathlib.Path | None = None
        self._create()
        self._recover()
        self._slots_ready = self._make_slots()

    @property
    def path(self) -> pathlib.Path:
        return self._path

    # ----------------------------------------------------------------------------------- public

    def write(self, items: Sequence[tuple[TensorMeta, memoryview]]) -> None:
        """Persist a batch atomically: after a crash, reload sees all of it or none of it."""
        for meta, data in items:
            check_item(meta, data)
        if not items:
            return
        self._finish_pending()
        renames = self._write_temps(items)
        if len(renames) == 1:
            self._commit_single(*renames[0])
        else:
            self._commit_batch(renames)

    def remove(self, names: Sequence[str]) -> None:
        """Durably delete the files of ``names``; names without a file are skipped."""
        if not names:
            return
        self._finish_pending()
        for name in names:
            path = self._path / file_name(name)
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise PersistenceError(f"cannot remove {path}: {exc}") from exc
        self._sync_dir()

    def save_revision(self, revision: int) -> None:
        """Durably record the last version handed out. Stored files alone would let a restart after
        deletes hand out versions a client has already seen; this record bounds them from below.
        It is written in place, into space the file already has: no new disk space is needed."""
        if not self._slots_ready:
            self._slots_ready = self._make_slots(revision)
            if self._slots_ready:
                return
            # No room was ever found for the slots: the old way, which needs a new block.
            temp = self._new_temp()
            self._write_durably(temp, [str(revision).encode()])
            self._rename(temp.name, REVISION_FILE)
            self._sync_dir()
            return
        path = self._path / SLOTS_FILE
        try:
            fd = os.open(path, os.O_RDWR | _NOFOLLOW)
            try:
                slots = _read_slots(fd)
                older = min(range(len(_SLOT_OFFSETS)), key=lambda i: slots[i])
                os.pwrite(fd, _encode_slot(revision), _SLOT_OFFSETS[older])
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise PersistenceError(f"cannot record the revision in {path}: {exc}") from exc

    def load_revision(self) -> int:
        """The revision last saved by ``save_revision`` (0 if none)."""
        path = self._path / SLOTS_FILE
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            return self._legacy_revision()
        except OSError as exc:
            raise PersistenceError(f"cannot read {path}: {exc}") from exc
        try:
            return max(*_read_slots(fd), self._legacy_revision())
        except OSError as exc:
            raise PersistenceError(f"cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)

    def _legacy_revision(self) -> int:
        path = self._path / REVISION_FILE
        refuse_link(path)
        try:
            return int(path.read_text(encoding="ascii"))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            raise PersistenceError(f"cannot read {path}: {exc}") from exc

    def _make_slots(self, revision: int | None = None) -> bool:
        """Make ``revision.slots`` (one block, written out so that later saves need no new space)
        if it is not there; False, with a warning, if the disk has no room for it now."""
        if (self._path / SLOTS_FILE).exists():
            return True
        start = max(self._legacy_revision(), revision or 0)
        body = bytearray(_SLOTS_BYTES)
        for offset in _SLOT_OFFSETS:
            body[offset : offset + _SLOT.size] = _encode_slot(start)
        temp = self._new_temp()
        try:
            self._write_durably(temp, [bytes(body)])
            self._rename(temp.name, SLOTS_FILE)
            self._sync_dir()
        except PersistenceError as exc:
            _unlink_quietly(temp)
            event(log, logging.WARNING, "revision slots not made: deletes need disk space until they are",
                  path=str(self._path), error=str(exc))  # fmt: skip
            return False
        return True

    def load(self) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
        """Every stored tensor: its meta (with version) and its bytes as a 1-D uint8 tensor."""
        for entry in sorted(self._listdir()):
            if entry.endswith(SUFFIX):
                path = self._path / entry
                refuse_link(path)
                yield read_file(path)

    # ------------------------------------------------------------------------------ filesystem

    def _create(self) -> None:
        if self._path.is_dir():
            return
        try:
            self._path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PersistenceError(f"cannot create data directory {self._path}: {exc}") from exc
        # The new directory's own entry must be durable too, or a crash could lose every file in it.
        sync_dir(self._path.parent)

    def _listdir(self) -> list[str]:
        try:
            return os.listdir(self._path)
        except OSError as exc:
            raise PersistenceError(f"cannot list data directory {self._path}: {exc}") from exc

    def _sync_dir(self) -> None:
        sync_dir(self._path)

    def _new_temp(self) -> pathlib.Path:
        return self._path / f"{TEMP_PREFIX}{uuid.uuid4().hex}"

    def _write_durably(self, path: pathlib.Path, chunks: Sequence[bytes | memoryview]) -> None:
        write_durably(path, chunks)

    def _rename(self, temp: str, final: str) -> None:
        src, dst = self._path / temp, self._path / final
        try:
            os.replace(src, dst)
        except OSError as exc:
            raise PersistenceError(f"cannot rename {src} to {dst}: {exc}") from exc

    # ----------------------------------------------------------------------------------- write

    def _write_temps(self, items: Sequence[tuple[TensorMeta, memoryview]]) -> list[tuple[str, str]]:
        """Write every item to its own fsynced temp; all of them, or (on failure) none remain."""
        renames: list[tuple[str, str]] = []
        try:
            for meta, data in items:
                temp = self._new_temp()
                self._write_durably(temp, (encode_header(meta), data))
                renames.append((temp.name, file_name(meta.name)))
        except PersistenceError:
            self._discard_temps(renames)
            raise
        return renames

    def _discard_temps(self, renames: Sequence[tuple[str, str]]) -> None:
        for temp, _final in renames:
            _unlink_quietly(self._path / temp)

    def _commit_single(self, temp: str, final: str) -> None:
        try:
            self._rename(temp, final)
        except PersistenceError:
            _unlink_quietly(self._path / temp)  # the rename did not happen: the old value stands
            raise
        self._sync_dir()

    def _commit_batch(self, renames: list[tuple[str, str]]) -> None:
        try:
            journal = self._write_journal(renames)
        except PersistenceError:
            # No rename has run: with its temps gone, even a journal that did reach the disk
            # replays to nothing, so the batch is cleanly "none".
            self._discard_temps(renames)
            raise
        self._pending_journal = journal
        for temp, final in renames:
            self._rename(temp, final)  # on failure the journal stays pending; see _finish_pending
        self._sync_dir()
        self._pending_journal = None
        self._delete_journal(journal)

    def _write_journal(self, renames: list[tuple[str, str]]) -> pathlib.Path:
        """Make the list of renames durable under ``journal-<uuid>.json``; this commits the batch."""
        journal = self._path / f"{JOURNAL_PREFIX}{uuid.uuid4().hex}{JOURNAL_SUFFIX}"
        temp = self._new_temp()
        body = json.dumps({"renames": [list(r) for r in renames]}).encode("utf-8")
        self._write_durably(temp, (body,))
        try:
            self._rename(temp.name, journal.name)
        except PersistenceError:
            _unlink_quietly(temp)
            raise
        self._sync_dir()
        return journal

    def _delete_journal(self, journal: pathlib.Path) -> None:
        # Not fsynced: a journal that reappears after a crash names only temps already renamed.
        try:
            journal.unlink(missing_ok=True)
        except OSError as exc:
            raise PersistenceError(f"cannot delete journal {journal}: {exc}") from exc

    def _finish_pending(self) -> None:
        """Complete a batch whose renames failed earlier, before anything newer can be written."""
        if self._pending_journal is not None:
            self._replay(self._pending_journal)
            self._sync_dir()
            self._delete_journal(self._pending_journal)
            self._pending_journal = None

    # -------------------------------------------------------------------------------- recovery

    def _recover(self) -> None:
        """Finish every committed batch, then delete the temps of batches that never committed."""
        entries = self._listdir()
        journals = [
            self._path / e for e in entries if e.startswith(JOURNAL_PREFIX) and e.endswith(JOURNAL_SUFFIX)
        ]
        for journal in sorted(journals):
            self._replay(journal)
        if journals:
            self._sync_dir()  # the replayed renames must be durable before their journal goes
        for journal in journals:
            self._delete_journal(journal)
        for entry in self._listdir():
            if entry.startswith(TEMP_PREFIX):
                # Any temp still here was named by no journal (a replay renamed all of those).
                self._unlink(self._path / entry)

    def _replay(self, journal: pathlib.Path) -> None:
        for temp, final in _read_journal(journal):
            # A temp already gone was renamed before the crash (or before a failed rename).
            if (self._path / temp).exists():
                self._rename(temp, final)

    def _unlink(self, path: pathlib.Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise PersistenceError(f"cannot delete {path}: {exc}") from exc


def _encode_slot(revision: int) -> bytes:
    raw = struct.pack("<Q", revision)
    return _SLOT.pack(revision, zlib.crc32(raw))


def _read_slots(fd: int) -> list[int]:
    """The revision in each slot (0 for a slot that is torn or blank)."""
    found = []
    for offset in _SLOT_OFFSETS:
        raw = os.pread(fd, _SLOT.size, offset)
        revision, crc = _SLOT.unpack(raw) if len(raw) == _SLOT.size else (0, 1)
        found.append(revision if zlib.crc32(struct.pack("<Q", revision)) == crc else 0)
    return found


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
        _unlink_quietly(path)
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


def _read_journal(journal: pathlib.Path) -> list[tuple[str, str]]:
    """The (temp, final) renames of a journal; PersistenceError if it is unreadable or malformed."""
    refuse_link(journal)
    try:
        body = json.loads(journal.read_bytes())
        renames = [(str(temp), str(final)) for temp, final in body["renames"]]
    except OSError as exc:
        raise PersistenceError(f"cannot read journal {journal}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise PersistenceError(f"corrupt journal {journal}: {exc!r}") from exc
    for temp, final in renames:
        # A journal only ever names plain entries of its own directory; refuse anything else.
        plain = all(os.sep not in n and "/" not in n for n in (temp, final))
        if not (plain and temp.startswith(TEMP_PREFIX) and final.endswith(SUFFIX)):
            raise PersistenceError(f"corrupt journal {journal}: bad entry {temp!r} -> {final!r}")
    return renames


# ------------------------------------------------------------------------------------------ reading


def read_file(path: pathlib.Path) -> tuple[TensorMeta, torch.Tensor]:
    """One stored tensor: its meta and bytes (1-D uint8); PersistenceError naming ``path`` if bad."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            metadata: dict[str, str] | None = f.metadata()
            keys: list[str] = list(f.keys())
            if len(keys) != 1:
                raise PersistenceError(f"corrupt {path}: holds {len(keys)} tensors, expected 1")
            stored: torch.Tensor = f.get_tensor(keys[0])
    except PersistenceError:
        raise
    except OSError as exc:
        raise PersistenceError(f"cannot read {path}: {exc}") from exc
    except (safetensors.SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise PersistenceError(f"corrupt {path}: {exc}") from exc
    name = keys[0]
    if path.name != file_name(name):
        raise PersistenceError(f"corrupt {path}: holds tensor {name!r}, whose file is {file_name(name)}")
    dtype, shape, version = _parse_metadata(path, metadata)
    data = _stored_bytes(path, stored, dtype, shape)
    meta = TensorMeta(name, dtype, shape, data.numel(), version)
    try:
        meta.check_size()
    except InvalidTensor as exc:
        raise PersistenceError(f"corrupt {path}: {exc}") from exc
    return meta, data


def _parse_metadata(
    path: pathlib.Path, metadata: dict[str, str] | None
) -> tuple[torch.dtype, tuple[int, ...], int]:
    """dtype, shape and version from a file's ``__metadata__``; PersistenceError if any is bad."""
    if not metadata or not {META_VERSION, META_DTYPE, META_SHAPE} <= metadata.keys():
        raise PersistenceError(f"corrupt {path}: no tensorwire metadata (not written by tensorwire?)")
    try:
        version = int(metadata[META_VERSION])
        dtype = dtype_from_name(metadata[META_DTYPE])
        shape = json.loads(metadata[META_SHAPE])
    except (ValueError, InvalidTensor) as exc:
        raise PersistenceError(f"corrupt {path}: bad tensorwire metadata: {exc}") from exc
    is_shape = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    if not is_shape or version < 0:
        raise PersistenceError(f"corrupt {path}: bad shape {shape!r} or version {version}")
    return dtype, tuple(shape), version


def _stored_bytes(
    path: pathlib.Path, stored: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """The raw bytes of ``stored`` as 1-D uint8, once its dtype/shape agree with the metadata."""
    if stored.dtype == dtype and tuple(stored.shape) == shape:
        # reshape(-1) first: a 0-dim tensor cannot be viewed as a dtype of another itemsize.
        return stored.reshape(-1).view(torch.uint8)
    # Dtypes without a safetensors code (or unknown to the safetensors that wrote the file) are raw U8.
    if stored.dtype == torch.uint8 and stored.dim() == 1:
        return stored
    raise PersistenceError(
        f"corrupt {path}: stored as {stored.dtype} {tuple(stored.shape)}, metadata says {dtype} {shape}"
    )
