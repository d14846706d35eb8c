"""``tensorwire dataset fetch``: write a node's shards back to files, each item checked on the way.

``--by files`` data sets come back as the same files, byte for byte, under their relative paths;
``--by rows`` ones as one ``<dataset>-shard-<k>.safetensors`` per shard holding its rows of every
tensor. Files are written to a temporary name and renamed, and a file already there with the
right bytes is left alone, so an interrupted fetch can be re-run. Paths come from the server's
manifest: each is checked to be plain components under ``--out``, and nothing below ``--out`` is
reached through a symlink (``tensorwire._fs``).
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
from tensorwire.errors import InvalidName
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.tensors import byte_view


@dataclass(slots=True)
class FetchReport:
    dataset: str
    by: str
    shards: list[int]
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "by": self.by, "shards": self.shards, "bytes": self.bytes,
                "written": len(self.written), "unchanged": len(self.unchanged)}  # fmt: skip


def fetch(
    source: str | Path,
    out: Path,
    dataset: str | None = None,
    options: ClientOptions | None = None,
    deadline: Deadline | None = None,
) -> FetchReport:
    """Write the complete shards of ``dataset`` held at ``source`` (URL or data dir) under ``out``.

    Every path a manifest names is checked to be plain components under ``out``, and written
    without following any symlink below ``out`` (``tensorwire._fs``). ``deadline`` bounds the whole
    fetch (the client's calls too, when ``options`` carries it): TransferTimeout past it. Without
    ``options``, a server on this host that serves shm:// is read through it (``prefer_local``).
    """
    shards = LocalShards(source, dataset, options or ClientOptions(prefer_local=True))
    report = FetchReport(shards.dataset, shards.by, [s.index for s in shards.shards])
    try:
        with SafeDir(out) as root:
            for shard in shards.shards:
                if shards.by == "files":
                    _fetch_files(shards, shard, root, report, deadline)
                else:
                    _fetch_rows(shards, shard, root, report)
    finally:
        shards.close()
    return report


def _fetch_files(
    shards: LocalShards, shard: ShardInfo, root: SafeDir, report: FetchReport, deadline: Deadline | None
) -> None:
    for item in shard.items:
        if deadline is not None:
            deadline.check()
        # A manifest is data from the network: "", ".", "sub/..", "/etc/x" never name a file here.
        parts = relative_parts(item["path"], f"{shards.dataset} shard {shard.index} (--out {root.root})")
        report.bytes += item["nbytes"]
        if _same_file(root, parts, item):
            report.unchanged.append(item["path"])
            continue
        data = byte_view(shards.read(item).contiguous())
        root.write(parts, data)
        report.written.append(item["path"])


def _fetch_rows(shards: LocalShards, shard: ShardInfo, root: SafeDir, report: FetchReport) -> None:
    from safetensors.torch import save

    parts: dict[str, list[torch.Tensor]] = {key: [] for key in shards.keys}
    for item in shard.items:
        parts[item["key"]].append(shards.read(item))
        report.bytes += item["nbytes"]
    name = f"{shards.dataset.replace('/', '-')}-shard-{shard.index:05d}.safetensors"
    target = relative_parts(name, f"the file for shard {shard.index} (--out {root.root})")
    if len(target) != 1:
        raise InvalidName(f"{name!r} is not a plain file name")
    tensors = {key: torch.cat(blocks) for key, blocks in parts.items() if blocks}
    data = save(tensors)
    root.write(target, data)
    report.written.append(name)


def _same_file(root: SafeDir, parts: list[str], item: dict[str, Any]) -> bool:
    """Whether a regular file with the item's bytes is there already (a link never counts)."""
    if root.size_of(parts) != item["nbytes"]:
        return False
    held = root.read_regular(parts)
    return held is not None and f"{checksum(ChecksumKind.XXH3_64, held):016x}" == str(item["xxh3"])
