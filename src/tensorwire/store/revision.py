"""The last version a data directory's store handed out, recorded so that deletes work on a
full disk (store/persist.py's ``DataDir`` owns one).

A delete must first make the last version handed out durable (else a restart could hand out a
deleted version again), and it must work when the disk is full, since deleting is how space is
freed. So that version lives in ``revision.slots``, a file of one block written once when the
directory is opened and overwritten in place afterwards, which takes no new disk space. It holds
two slots, each ``u64 revision | u32 crc32`` at its own 512-byte sector; a save overwrites the slot
holding the smaller revision and fsyncs, so a torn write leaves the other slot, and the files not
yet removed, to bound the versions from below. A directory written before this file existed has
a text file ``revision``, still read. Files are opened without following symbolic links.
"""

from __future__ import annotations

import logging
import os
import pathlib
import struct
import zlib

from tensorwire.errors import PersistenceError
from tensorwire.logs import event
from tensorwire.store.files import (
    NOFOLLOW,
    new_temp,
    refuse_link,
    rename,
    sync_dir,
    unlink_quietly,
    write_durably,
)

REVISION_FILE = "revision"  # the text file of data directories written before revision.slots
SLOTS_FILE = "revision.slots"
_SLOT = struct.Struct("<QI")  # revision, crc32 of its 8 bytes
_SLOT_OFFSETS = (0, 512)  # one sector each: a torn write damages at most one
_SLOTS_BYTES = 4096  # one block, allocated when the file is made

log = logging.getLogger("tensorwire.store")


class Revisions:
    """The revision record of the data directory ``path`` (module docstring)."""

    def __init__(self, path: pathlib.Path) -> None:
        self._path = path
        self._slots_ready = self._make_slots()

    def save(self, revision: int) -> None:
        """Durably record the last version handed out. Stored files alone would let a restart after
        deletes hand out versions a client has already seen; this record bounds them from below.
        It is written in place, into space the file already has: no new disk space is needed."""
        if not self._slots_ready:
            self._slots_ready = self._make_slots(revision)
            if self._slots_ready:
                return
            # No room was ever found for the slots: the old way, which needs a new block.
            temp = new_temp(self._path)
            write_durably(temp, [str(revision).encode()])
            rename(self._path, temp.name, REVISION_FILE)
            sync_dir(self._path)
            return
        path = self._path / SLOTS_FILE
        try:
            fd = os.open(path, os.O_RDWR | NOFOLLOW)
            try:
                slots = _read_slots(fd)
                older = min(range(len(_SLOT_OFFSETS)), key=lambda i: slots[i])
                os.pwrite(fd, _encode_slot(revision), _SLOT_OFFSETS[older])
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise PersistenceError(f"cannot record the revision in {path}: {exc}") from exc

    def load(self) -> int:
        """The revision last saved by ``save`` (0 if none)."""
        path = self._path / SLOTS_FILE
        try:
            fd = os.open(path, os.O_RDONLY | NOFOLLOW)
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
        temp = new_temp(self._path)
        try:
            write_durably(temp, [bytes(body)])
            rename(self._path, temp.name, SLOTS_FILE)
            sync_dir(self._path)
        except PersistenceError as exc:
            unlink_quietly(temp)
            event(log, logging.WARNING, "revision slots not made: deletes need disk space until they are",
                  path=str(self._path), error=str(exc))  # fmt: skip
            return False
        return True


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
