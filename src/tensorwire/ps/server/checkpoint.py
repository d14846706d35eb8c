"""Parameter-server checkpoints: a server's whole job state, on disk, all or nothing.

A checkpoint is a directory ``ckpt-<version>`` (``ckpt-<version>.<n>`` for the n-th rewrite of the
same version, e.g. the final save at exit after a periodic one) holding

* ``params.safetensors``: every shard, by shard key (readable by ``safetensors.torch.load_file``);
* ``optimizer.safetensors``: the optimizer's tensors (momentum buffers, Adam moments and steps),
  keyed ``"<param index>/<name>"``;
* ``state.json``: the job's config, step, version, the workers' clocks and push marks (so a
  restored server still recognises a resent push), the optimizer's non-tensor state, and the size
  of each of the other two files (``files``), by which a torn checkpoint is told from a whole one.

Writing never puts a published checkpoint at risk: the new one is written into a fresh private
temporary directory beside the others, every file fsynced, then published by one rename to a name
no checkpoint has, and the parent directory fsynced. Only then are older copies of the same
version, and the checkpoints older than the newest ``KEEP`` versions, removed. A crash at any
moment (a SIGKILL during the shutdown checkpoint) leaves every published checkpoint whole, and at
most a stray temporary directory (removed at the next save). The newest ``KEEP`` versions are kept
so that servers of one job that crashed between their own saves of the same step can all go back
to a common one.

A server keeps each job's checkpoints in a directory of its own, ``<checkpoint dir>/<job id>``
(ps/server/jobs.py). A job that ends is ``retire``d: its directory moves to
``<checkpoint dir>/_ended/<job id>.<n>`` (``_`` starts no job id), so a server started again does
not resume it and a new job of the same id starts afresh, while its last checkpoint stays on disk.

Loading takes the newest *complete* checkpoint: one whose files are missing, of another size than
``state.json`` says, or unreadable (torn by an older release's save, by a full disk, by hand) is
skipped with a warning, and the next older one is tried. Nothing in the checkpoint directory is
followed if it is a symbolic link: such an entry is never a checkpoint, a file, or removed through.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tensorwire.errors import PersistenceError
from tensorwire.logs import event

log = logging.getLogger("tensorwire.ps.checkpoint")
KEEP = 3
FORMAT = 1
_PREFIX = "ckpt-"
_TMP = ".tmp-"
_NAME = re.compile(r"ckpt-(\d{1,20})(?:\.(\d{1,9}))?")
_FILES = ("params.safetensors", "optimizer.safetensors")
_STATE = "state.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass
class Snapshot:
    """What a checkpoint holds, in memory (``path`` and ``skipped``: where a load found it, and
    the newer checkpoints it had to pass over because they were not complete)."""

    state: dict[str, Any]  # JSON-able
    params: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    path: Path | None = None
    skipped: list[str] = field(default_factory=list)


class _Entry(NamedTuple):
    version: int
    copy: int  # 0 for ``ckpt-<version>``, n for ``ckpt-<version>.<n>``
    path: Path


def save(directory: Path, version: int, snapshot: Snapshot) -> Path:
    """Write ``snapshot`` as checkpoint ``version`` of ``directory``; return its path."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # mkdtemp: a new directory of our own (mode 0700), never one planted under a known name.
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP}{version:012d}-{os.getpid()}-", dir=directory))
    except OSError as exc:
        raise PersistenceError(f"could not write a checkpoint into {directory}: {exc}") from exc
    try:
        _write(tmp, snapshot)
        final = _unused_name(directory, version)
        os.rename(tmp, final)
        _fsync(directory, follow=True)  # the configured directory may be a link; its entries not
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PersistenceError(f"could not write a checkpoint into {directory}: {exc}") from exc
    _prune(directory)  # only now: the new one is published
    return final


def _write(tmp: Path, snapshot: Snapshot) -> None:
    """Every file of the checkpoint into ``tmp``, fsynced; ``state.json`` (with the others' sizes)
    last."""
    save_file(snapshot.params, str(tmp / _FILES[0]))
    save_file(snapshot.optimizer, str(tmp / _FILES[1]))
    sizes = {}
    for name in _FILES:
        _fsync(tmp / name)
        sizes[name] = os.lstat(tmp / name).st_size
    text = json.dumps({"format": FORMAT, "files": sizes, **snapshot.state}, sort_keys=True)
    fd = os.open(tmp / _STATE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    _fsync(tmp)


def _unused_name(directory: Path, version: int) -> Path:
    """``ckpt-<version>``, or the next ``ckpt-<version>.<n>`` when that version was written before:
    a new checkpoint never replaces one in place."""
    copies = [e.copy for e in _entries(directory) if e.version == version]
    base = directory / f"{_PREFIX}{version:012d}"
    n = max(copies) + 1 if copies else 0
    while os.path.lexists(_copy_path(base, n)):  # something else holds the name: not a checkpoint
        n += 1
    return _copy_path(base, n)


def _copy_path(base: Path, n: int) -> Path:
    return base if n == 0 else base.with_name(f"{base.name}.{n}")


def available(directory: Path) -> list[int]:
    """The versions of the checkpoints in ``directory`` (published, maybe not complete), oldest
    first."""
    return sorted({e.version for e in _entries(directory)})


def load(directory: Path, version: int | None = None) -> Snapshot | None:
    """The newest complete checkpoint of ``directory`` (of ``version``, if given), or None if there
    is none at all. Newer ones that are not complete are skipped, each with a warning, and listed
    in the answer's ``skipped``; PersistenceError when there are checkpoints but none is complete
    (starting a fresh job over them would lose the training silently)."""
    candidates = [e for e in _entries(directory) if version is None or e.version == version]
    skipped: list[str] = []
    for entry in reversed(candidates):
        try:
            snapshot = _read(entry.path)
        except PersistenceError as exc:
            skipped.append(f"{entry.path.name}: {exc}")
            event(log, logging.WARNING, "checkpoint not complete: skipped, trying an older one",
                  path=str(entry.path), error=str(exc))  # fmt: skip
            continue
        snapshot.path, snapshot.skipped = entry.path, skipped
        return snapshot
    if skipped:
        raise PersistenceError(f"no complete checkpoint in {directory}: {'; '.join(skipped)}")
    return None


def _read(path: Path) -> Snapshot:
    """The checkpoint in ``path``; PersistenceError saying what is missing or wrong."""
    try:
        fd = os.open(path / _STATE, os.O_RDONLY | _NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8") as source:
            state = json.loads(source.read())
        if not isinstance(state, dict) or state.pop("format", None) != FORMAT:
            raise PersistenceError(f"{_STATE} of {path} has an unknown format")
        sizes = state.pop("files", None) or {}
        for name in _FILES:
            info = os.lstat(path / name)
            if not stat.S_ISREG(info.st_mode):
                raise PersistenceError(f"{name} of {path} is not a regular file")
            if name in sizes and sizes[name] != info.st_size:
                raise PersistenceError(f"{name} of {path} has {info.st_size} bytes, not {sizes[name]}")
        params = load_file(str(path / _FILES[0]))
        optimizer = load_file(str(path / _FILES[1]))
    except PersistenceError:
        raise
    except (OSError, ValueError, TypeError, KeyError, RecursionError, SafetensorError) as exc:
        raise PersistenceError(f"checkpoint {path} cannot be read: {exc}") from exc
    return Snapshot(state, params, optimizer)


def _entries(directory: Path) -> list[_Entry]:
    """The checkpoint directories in ``directory``, oldest first; symbolic links are not."""
    try:
        scan = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise PersistenceError(f"cannot list the checkpoints in {directory}: {exc}") from exc
    entries = []
    for item in scan:
        match = _NAME.fullmatch(item.name)
        if match and not item.is_symlink() and item.is_dir(follow_symlinks=False):
            entries.append(_Entry(int(match[1]), int(match[2] or 0), Path(item.path)))
    return sorted(entries)


ENDED = "_ended"  # where the checkpoints of ended jobs go (no job id starts with "_")


def retire(directory: Path) -> Path | None:
    """Move a job's checkpoint ``directory`` to ``../_ended/<name>.<n>`` (a name not used yet);
    its path, or None if there was none. Nothing is followed if it is a symbolic link."""
    if not os.path.isdir(directory) or os.path.islink(directory):
        return None
    ended = directory.parent / ENDED
    try:
        ended.mkdir(exist_ok=True)
        if ended.is_symlink() or not ended.is_dir():
            raise PersistenceError(f"{ended} is not a directory of this server's")
        n = 1
        while os.path.lexists(ended / f"{directory.name}.{n}"):
            n += 1
        target = ended / f"{directory.name}.{n}"
        os.rename(directory, target)
        _fsync(directory.parent, follow=True)
    except OSError as exc:
        raise PersistenceError(f"could not move the checkpoints of an ended job to {ended}: {exc}") from exc
    return target


def has_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` holds checkpoints itself (a release before jobs wrote them there)."""
    return bool(_entries(directory))


def optimizer_tensors(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into its tensors and the JSON-able rest."""
    tensors: dict[str, torch.Tensor] = {}
    rest: dict[str, Any] = {"param_groups": state_dict["param_groups"], "state": {}}
    for index, entry in state_dict["state"].items():
        plain = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}/{name}"] = value.detach().contiguous()
            else:
                plain[name] = value
        rest["state"][str(index)] = plain
    return tensors, rest


def optimizer_state(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``optimizer_tensors``: a dict ``optimizer.load_state_dict`` takes."""
    state: dict[int, dict[str, Any]] = {int(i): dict(entry) for i, entry in rest["state"].items()}
    for key, value in tensors.items():
        index, _, name = key.partition("/")
        state.setdefault(int(index), {})[name] = value
    # JSON made tuples (Adam's betas) into lists: give them back as torch wrote them.
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in group.items()}
              for group in rest["param_groups"]]  # fmt: skip
    return {"state": state, "param_groups": groups}


def _prune(directory: Path) -> None:
    """Remove what a published checkpoint made redundant: older copies of each version, versions
    older than the newest ``KEEP``, and temporary directories of crashed processes. Failures are
    only logged: the new checkpoint is published whatever happens here."""
    entries = _entries(directory)
    keep = set(sorted({e.version for e in entries})[-KEEP:])
    newest = {e.version: e.copy for e in entries}  # entries are sorted: the last copy wins
    doomed = [e.path for e in entries if e.version not in keep or e.copy != newest[e.version]]
    with contextlib.suppress(OSError):
        doomed += [
            Path(item.path)
            for item in os.scandir(directory)
            if item.name.startswith(_TMP)
            and f"-{os.getpid()}-" not in item.name
            and item.is_dir(follow_symlinks=False)
        ]
    for path in doomed:
        try:
            shutil.rmtree(path)  # does not follow symbolic links inside
        except OSError as exc:
            log.warning("could not remove the old checkpoint %s: %s", path, exc)


def _fsync(path: Path, *, follow: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (0 if follow else _NOFOLLOW))
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)
