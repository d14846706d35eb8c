"""``tensorwire dataset fetch``: write a node's shards back to files, each item checked on the way.

``--by files`` data sets come back as the same files, byte for byte, under their relative paths;
``--by rows`` ones as one ``<dataset>-shard-<k>.safetensors`` per shard holding its rows of every
tensor. Files are written to a temporary name and renamed, and a file already there with the
right bytes is left alone, so an interrupted fetch can be re-run. Paths come from the server's
manifest: each is checked to be plain components under ``--out``, and nothing below ``--out`` is
reached through a symlink (``tensorwire._fs``).

A regular file already under ``--out`` with other bytes than the data set's (another data set,
a file someone edited, an older version of this one) is not overwritten: the fetch refuses with
``DatasetConflict`` naming them, before it writes anything, unless ``replace``. (A symlink, FIFO or
device at an item's path holds no data of its own: it is replaced, never written through.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tensorwire._aio import Deadline
from tensorwire._fs import SafeDir, relative_parts
from tensorwire.client.core import ClientOptions
from tensorwire.dataset.reader import LocalShards, ShardInfo
from tensorwire.errors import DatasetConflict, InvalidName
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.tensors import byte_view


@dataclass(slots=True)
class FetchReport:
    dataset: str
    by: str
    shards: list[int]
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # written over a file with other bytes (replace)
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "by": self.by, "shards": self.shards, "bytes": self.bytes,
                "written": len(self.written), "unchanged": len(self.unchanged),
                "replaced": len(self.replaced)}  # fmt: skip


def fetch(
    source: str | Path,
    out: Path,
    dataset: str | None = None,
    options: ClientOptions | None = None,
    deadline: Deadline | None = None,
    *,
    replace: bool = False,
) -> FetchReport:
    """Write the complete shards of ``dataset`` held at ``source`` (URL or data dir) under ``out``.

    Every path a manifest names is checked to be plain components under ``out``, and written
    without following any symlink below ``out`` (``tensorwire._fs``). ``deadline`` bounds the whole
    fetch (the client's calls too, when ``options`` carries it): TransferTimeout past it. Without
    ``options``, a server on this host that serves shm:// is read through it (``prefer_local``).
    DatasetConflict, before anything is written, if a regular file under ``out`` has other bytes
    than the data set's at its path, unless ``replace``.
    """
    shards = LocalShards(source, dataset, options or ClientOptions(prefer_local=True))
    report = FetchReport(shards.dataset, shards.by, [s.index for s in shards.shards])
    try:
        with SafeDir(out) as root:
            if shards.by == "files":
                _fetch_files(shards, root, report, deadline, replace)
            else:
                _fetch_rows(shards, root, report, deadline, replace)
    finally:
        shards.close()
    return report


Target = tuple[list[str], dict[str, Any]]  # an item's path under --out (checked), and the item


def _fetch_files(
    shards: LocalShards, root: SafeDir, report: FetchReport, deadline: Deadline | None, replace: bool
) -> None:
    """Every file of every shard: all paths are checked and every file there compared first, so
    a refused fetch (a bad path, a file with other bytes) writes nothing."""
    todo: list[Target] = []
    other: list[Target] = []
    for shard in shards.shards:
        for item in shard.items:
            if deadline is not None:
                deadline.check()
            # A manifest is data from the network: "", ".", "sub/..", "/etc/x" never name a file here.
            where = f"{shards.dataset} shard {shard.index} (--out {root.root})"
            parts = relative_parts(item["path"], where)
            report.bytes += item["nbytes"]
            held = _held(root, parts, item)
            if held == "same":
                report.unchanged.append(item["path"])
            else:
                (other if held == "other" else todo).append((parts, item))
    if other and not replace:
        raise _overwrite_refused(root, [item["path"] for _, item in other], len(todo))
    for parts, item in todo + other:
        if deadline is not None:
            deadline.check()
        root.write(parts, byte_view(shards.read(item).contiguous()))
        report.written.append(item["path"])
    report.replaced.extend(item["path"] for _, item in other)


def _fetch_rows(
    shards: LocalShards, root: SafeDir, report: FetchReport, deadline: Deadline | None, replace: bool
) -> None:
    """One safetensors file per shard. Where one is there already, its shard is built and compared
    first: a refused fetch writes nothing."""
    targets = [(shard, _rows_file(shards, shard, root)) for shard in shards.shards]
    todo: list[tuple[ShardInfo, list[str]]] = []
    other: list[str] = []
    for shard, target in targets:
        report.bytes += sum(item["nbytes"] for item in shard.items)
        if root.size_of(target) is None:
            todo.append((shard, target))
        elif root.read_regular(target) == _rows_data(shards, shard, deadline):
            report.unchanged.append(target[0])
        else:
            todo.append((shard, target))
            other.append(target[0])
    if other and not replace:
        raise _overwrite_refused(root, other, len(todo) - len(other))
    for shard, target in todo:
        root.write(target, _rows_data(shards, shard, deadline))
        report.written.append(target[0])
    report.replaced.extend(other)


def _rows_file(shards: LocalShards, shard: ShardInfo, root: SafeDir) -> list[str]:
    name = f"{shards.dataset.replace('/', '-')}-shard-{shard.index:05d}.safetensors"
    target = relative_parts(name, f"the file for shard {shard.index} (--out {root.root})")
    if len(target) != 1:
        raise InvalidName(f"{name!r} is not a plain file name")
    return target


def _rows_data(shards: LocalShards, shard: ShardInfo, deadline: Deadline | None) -> bytes:
    """The shard's rows of every tensor, as the bytes of a safetensors file."""
    from safetensors.torch import save

    parts: dict[str, list[torch.Tensor]] = {key: [] for key in shards.keys}
    for item in shard.items:
        if deadline is not None:
            deadline.check()
        parts[item["key"]].append(shards.read(item))
    return save({key: torch.cat(blocks) for key, blocks in parts.items() if blocks})


def _held(root: SafeDir, parts: list[str], item: dict[str, Any]) -> str:
    """What ``root`` holds at ``parts``: "same" (a regular file with the item's bytes), "other" (a
    regular file with other bytes: data a write would lose) or "none" (nothing, or a link, FIFO or
    device, which holds no data of its own and is replaced)."""
    size = root.size_of(parts)
    if size is None:
        return "none"
    if size != item["nbytes"]:
        return "other"
    held = root.read_regular(parts)
    if held is None:  # replaced meanwhile by something that is not a regular file
        return "none"
    return "same" if f"{checksum(ChecksumKind.XXH3_64, held):016x}" == str(item["xxh3"]) else "other"


def _overwrite_refused(root: SafeDir, paths: list[str], new: int) -> DatasetConflict:
    shown = ", ".join(repr(p[:200]) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    return DatasetConflict(
        f"refusing to overwrite {len(paths)} file(s) under {root.root} whose bytes differ from the data "
        f"set's: {shown}. Pass --replace to overwrite them, or fetch into another --out. Nothing was "
        f"written ({new} other file(s) are missing there)."
    )
