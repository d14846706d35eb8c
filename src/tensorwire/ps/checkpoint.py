"""Parameter-server checkpoints: a server's whole job state, on disk, all or nothing.

A checkpoint is a directory ``ckpt-<version>`` holding

* ``params.safetensors``: every shard, by shard key (readable by ``safetensors.torch.load_file``);
* ``optimizer.safetensors``: the optimizer's tensors (momentum buffers, Adam moments and steps),
  keyed ``"<param index>/<name>"``;
* ``state.json``: the job's config, step, version, the workers' clocks and push marks (so a
  restored server still recognises a resent push), and the optimizer's non-tensor state.

It is written into a temporary directory, every file fsynced, then renamed into place and the
parent directory fsynced: a crash leaves the previous checkpoint and at most a stray temporary
directory (removed at the next save). The newest ``KEEP`` checkpoints are kept, so that servers
of one job that crashed between their own saves of the same step can all go back to a common one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tensorwire.errors import PersistenceError

KEEP = 3
FORMAT = 1
_PREFIX = "ckpt-"
_TMP = ".tmp-"


@dataclass
class Snapshot:
    """What a checkpoint holds, in memory."""

    state: dict[str, Any]  # JSON-able
    params: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]


def save(directory: Path, version: int, snapshot: Snapshot) -> Path:
    """Write ``snapshot`` as checkpoint ``version`` of ``directory``; return its path."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"{_PREFIX}{version:012d}"
        tmp = directory / f"{_TMP}{version:012d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(snapshot.params, str(tmp / "params.safetensors"))
        save_file(snapshot.optimizer, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"format": FORMAT, **snapshot.state}, sort_keys=True))
        for name in ("params.safetensors", "optimizer.safetensors", "state.json"):
            _fsync(tmp / name)
        _fsync(tmp)
        if final.exists():  # the same version again (e.g. a final save at exit): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(directory)
        _prune(directory)
        return final
    except OSError as exc:
        raise PersistenceError(f"could not write a checkpoint into {directory}: {exc}") from exc


def available(directory: Path) -> list[int]:
    """The versions of the complete checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    versions = []
    for path in directory.iterdir():
        if path.name.startswith(_PREFIX) and path.name[len(_PREFIX) :].isdigit():
            versions.append(int(path.name[len(_PREFIX) :]))
    return sorted(versions)


def load(directory: Path, version: int | None = None) -> Snapshot | None:
    """Checkpoint ``version`` (default: the newest) of ``directory``, or None if there is none."""
    versions = available(directory)
    if version is None:
        if not versions:
            return None
        version = versions[-1]
    elif version not in versions:
        return None
    path = directory / f"{_PREFIX}{version:012d}"
    try:
        state = json.loads((path / "state.json").read_text())
        params = load_file(str(path / "params.safetensors"))
        optimizer = load_file(str(path / "optimizer.safetensors"))
    except (OSError, ValueError) as exc:
        raise PersistenceError(f"checkpoint {path} cannot be read: {exc}") from exc
    if state.pop("format", None) != FORMAT:
        raise PersistenceError(f"checkpoint {path} has an unknown format")
    return Snapshot(state, params, optimizer)


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
    for version in available(directory)[:-KEEP]:
        shutil.rmtree(directory / f"{_PREFIX}{version:012d}", ignore_errors=True)
    for stray in directory.glob(f"{_TMP}*"):
        if not stray.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stray, ignore_errors=True)  # left by a crashed process


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)
