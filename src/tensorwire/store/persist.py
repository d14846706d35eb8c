"""Durable, crash-safe storage of a tensor store in a data directory.

Layout
------
One file per key, ``<sha256(name as UTF-8) hex>.safetensors``, a safetensors file holding exactly
one tensor under its real name (store/tensor_file.py has the format).

Besides those files the directory may hold ``.tmp-<uuid>`` (a file being written),
``journal-<uuid>.json`` (a batch being committed), ``revision.slots`` (the last version handed
out: store/revision.py, so that deletes work on a full disk) and ``generations/`` (published
generations: written and read by store/generation_disk.py, with the same file helpers,
store/files.py); anything else is ignored. A stored tensor's file that is a symbolic link is
refused at start: tensorwire never makes one, and it would read another file.

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

A ``DataDir`` is not thread-safe; its owner serializes calls.
"""

from __future__ import annotations

import json
import os
import pathlib
import uuid
from collections.abc import Iterator, Sequence

import torch

from tensorwire.errors import PersistenceError
from tensorwire.store.files import (
    TEMP_PREFIX,
    new_temp,
    refuse_link,
    rename,
    sync_dir,
    unlink_quietly,
    write_durably,
)
from tensorwire.store.revision import Revisions
from tensorwire.store.tensor_file import SUFFIX, check_item, encode_header, file_name, read_file
from tensorwire.types import TensorMeta

JOURNAL_PREFIX = "journal-"
JOURNAL_SUFFIX = ".json"


class DataDir:
    """A directory of safetensors files, one per tensor; see the module docstring."""

    def __init__(self, path: pathlib.Path) -> None:
        self._path = pathlib.Path(path)
        self._pending_journal: pathlib.Path | None = None
        self._create()
        self._recover()
        self._revisions = Revisions(self._path)

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
        """Durably record the last version handed out (store/revision.py); no new disk space needed."""
        self._revisions.save(revision)

    def load_revision(self) -> int:
        """The revision last saved by ``save_revision`` (0 if none)."""
        return self._revisions.load()

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

    def _rename(self, temp: str, final: str) -> None:
        rename(self._path, temp, final)

    # ----------------------------------------------------------------------------------- write

    def _write_temps(self, items: Sequence[tuple[TensorMeta, memoryview]]) -> list[tuple[str, str]]:
        """Write every item to its own fsynced temp; all of them, or (on failure) none remain."""
        renames: list[tuple[str, str]] = []
        try:
            for meta, data in items:
                temp = new_temp(self._path)
                write_durably(temp, (encode_header(meta), data))
                renames.append((temp.name, file_name(meta.name)))
        except PersistenceError:
            self._discard_temps(renames)
            raise
        return renames

    def _discard_temps(self, renames: Sequence[tuple[str, str]]) -> None:
        for temp, _final in renames:
            unlink_quietly(self._path / temp)

    def _commit_single(self, temp: str, final: str) -> None:
        try:
            self._rename(temp, final)
        except PersistenceError:
            unlink_quietly(self._path / temp)  # the rename did not happen: the old value stands
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
        temp = new_temp(self._path)
        body = json.dumps({"renames": [list(r) for r in renames]}).encode("utf-8")
        write_durably(temp, (body,))
        try:
            self._rename(temp.name, journal.name)
        except PersistenceError:
            unlink_quietly(temp)
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
