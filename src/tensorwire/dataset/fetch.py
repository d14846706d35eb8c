"""``tensorwire dataset fetch``: write a node's shards back to files, each item checked on the way.

``--by files`` data sets come back as the same files, byte for byte, under their relative paths;
``--by rows`` ones as one ``<dataset>-shard-<k>.safetensors`` per shard holding its rows of every
tensor. Files are written to a temporary name and renamed, and a file already there with the
right bytes is left alone, so an interrupted fetch can be re-run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tensorwire.client import ClientOptions
from tensorwire.dataset.reader import LocalShards, ShardInfo
from tensorwire.errors import InvalidName
from tensorwire.wire.checksum import ChecksumKind, checksum


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
    source: str | Path, out: Path, dataset: str | None = None, options: ClientOptions | None = None
) -> FetchReport:
    """Write the complete shards of ``dataset`` held at ``source`` (URL or data dir) under ``out``."""
    shards = LocalShards(source, dataset, options)
    report = FetchReport(shards.dataset, shards.by, [s.index for s in shards.shards])
    try:
        out.mkdir(parents=True, exist_ok=True)
        for shard in shards.shards:
            if shards.by == "files":
                _fetch_files(shards, shard, out, report)
            else:
                _fetch_rows(shards, shard, out, report)
    finally:
        shards.close()
    return report


def _fetch_files(shards: LocalShards, shard: ShardInfo, out: Path, report: FetchReport) -> None:
    root = out.resolve()
    for item in shard.items:
        target = (out / item["path"]).resolve()
        if not target.is_relative_to(root):  # a manifest is data from the network: no path escapes
            raise InvalidName(f"{item['path']!r} would be written outside {out}")
        report.bytes += item["nbytes"]
        if target.exists() and _same_file(target, item):
            report.unchanged.append(item["path"])
            continue
        data = shards.read(item)
        _write_atomically(target, data.numpy().tobytes())
        report.written.append(item["path"])


def _fetch_rows(shards: LocalShards, shard: ShardInfo, out: Path, report: FetchReport) -> None:
    from safetensors.torch import save_file

    parts: dict[str, list[torch.Tensor]] = {key: [] for key in shards.keys}
    for item in shard.items:
        parts[item["key"]].append(shards.read(item))
        report.bytes += item["nbytes"]
    name = f"{shards.dataset.replace('/', '-')}-shard-{shard.index:05d}.safetensors"
    tensors = {key: torch.cat(blocks) for key, blocks in parts.items() if blocks}
    temp = out / f".{name}.tmp"
    save_file(tensors, str(temp))
    os.replace(temp, out / name)
    report.written.append(name)


def _same_file(path: Path, item: dict[str, Any]) -> bool:
    if path.stat().st_size != item["nbytes"]:
        return False
    return f"{checksum(ChecksumKind.XXH3_64, path.read_bytes()):016x}" == str(item["xxh3"])


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
