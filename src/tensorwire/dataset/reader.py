"""Reading the shards a node holds: from its server (a URL) or straight from its ``--data-dir``.

A ``LocalShards`` finds the complete shards of a data set on one node (those with a manifest:
a shard without one is still being sent) and reads their items, checking each against the
xxh3-64 its manifest recorded, so what a training job reads is what the source held. A manifest
is read only once its size is known to be within ``MAX_MANIFEST_BYTES``, and the shards read
together must come from one scatter (one identity, plan.py): a node left holding shards of two
trees under one name (an interrupted ``--replace``) is refused with ``DatasetConflict``.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tensorwire.client.core import Client, ClientOptions
from tensorwire.dataset.plan import MAX_MANIFEST_BYTES, parse_manifest
from tensorwire.errors import DatasetConflict, InvalidTensor, KeyNotFound, LimitExceeded, VerificationFailed
from tensorwire.store.tensor_file import SUFFIX, file_name, read_file
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.dtypes import dtype_name
from tensorwire.wire.tensors import byte_view

_MANIFEST = re.compile(r"^(?P<dataset>.+)/shard-(?P<shard>\d{5,})/manifest$")


class _Store(Protocol):
    def names(self, prefix: str) -> list[str]: ...
    def read(self, name: str) -> torch.Tensor: ...
    def size(self, name: str) -> int: ...  # bytes of the tensor ``name`` (KeyNotFound if none)
    def read_bytes(self, name: str, nbytes: int) -> torch.Tensor: ...  # a uint8 tensor of ``size``
    def close(self) -> None: ...


class _Server:
    """Reads through a client; reconnects in a forked process (a DataLoader worker)."""

    def __init__(self, url: str, options: ClientOptions | None) -> None:
        self.url = url
        self.options = options
        self._client: Client | None = None
        self._pid = 0

    def _conn(self) -> Client:
        if self._client is None or self._pid != os.getpid():
            self._client = Client(self.url, self.options)  # a parent's client is not usable after fork
            self._pid = os.getpid()
        return self._client

    def names(self, prefix: str) -> list[str]:
        return [meta.name for meta in self._conn().list(prefix)]

    def read(self, name: str) -> torch.Tensor:
        return self._conn().get(name)

    def size(self, name: str) -> int:
        return self._conn().stat(name).nbytes

    def read_bytes(self, name: str, nbytes: int) -> torch.Tensor:
        """``name`` as ``nbytes`` uint8 bytes, into a buffer of that size (a server that answers
        with another size is refused, not grown into)."""
        return self._conn().get(name, torch.empty(nbytes, dtype=torch.uint8))

    def close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = None


class _DataDir:
    """Reads the files a server persisted (one safetensors file per tensor, written atomically)."""

    def close(self) -> None:
        return None

    def __init__(self, path: Path) -> None:
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such data directory")
        self.path = path

    def names(self, prefix: str) -> list[str]:
        from safetensors import safe_open

        found: list[str] = []
        for path in sorted(self.path.glob("*" + SUFFIX)):
            with contextlib.suppress(FileNotFoundError), safe_open(str(path), framework="pt") as f:
                found.extend(k for k in f.keys() if k.startswith(prefix))  # noqa: SIM118 - deleted meanwhile: gone
        return sorted(found)

    def size(self, name: str) -> int:
        path = self.path / file_name(name)
        if not path.exists():
            raise KeyNotFound(f"no tensor named {name!r} in {self.path}")
        return path.stat().st_size  # the file: the tensor's bytes and a small header

    def read_bytes(self, name: str, nbytes: int) -> torch.Tensor:
        return self.read(name)

    def read(self, name: str) -> torch.Tensor:
        path = self.path / file_name(name)
        if not path.exists():
            raise KeyNotFound(f"no tensor named {name!r} in {self.path}")
        meta, data = read_file(path)
        return (
            data.view(meta.dtype).reshape(meta.shape)
            if meta.nbytes
            else torch.empty(meta.shape, dtype=meta.dtype)
        )


@dataclass(frozen=True, slots=True)
class ShardInfo:
    index: int
    manifest: dict[str, Any]

    @property
    def items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.manifest["items"]
        return items


class LocalShards:
    """The complete shards of one data set held by one node (``source``: a URL or a data dir)."""

    def __init__(
        self, source: str | Path, dataset: str | None = None, options: ClientOptions | None = None
    ) -> None:
        text = str(source)
        self.store: _Store = _Server(text, options) if "://" in text else _DataDir(Path(source))
        try:
            self.dataset, self.shards = self._find(str(source), dataset)
        except BaseException:
            self.store.close()
            raise
        first = self.shards[0].manifest
        self.by: str = first["by"]
        self.keys: list[str] = list(first["keys"])

    def _find(self, source: str, dataset: str | None) -> tuple[str, list[ShardInfo]]:
        """The data set's name and its shards with a manifest, in shard order."""
        found: dict[str, list[tuple[int, str]]] = {}
        for name in self.store.names(f"{dataset}/" if dataset else ""):
            match = _MANIFEST.match(name)
            if match:
                found.setdefault(match["dataset"], []).append((int(match["shard"]), name))
        if dataset is None and len(found) > 1:
            raise InvalidTensor(f"{source} holds several data sets ({', '.join(sorted(found))}): name one")
        if not found or (dataset is not None and dataset not in found):
            raise KeyNotFound(f"{source} holds no complete shard of {dataset or 'any data set'}")
        name = dataset or next(iter(found))
        shards = [ShardInfo(k, self._manifest(m)) for k, m in sorted(found[name])]
        identities = {str(s.manifest.get("identity")) for s in shards}
        if len(identities) > 1:
            raise DatasetConflict(
                f"{source} holds shards of {name!r} from {len(identities)} different scatters (one "
                "replaced the other and did not finish): re-run that `dataset scatter` to finish it"
            )
        return name, shards

    def _manifest(self, name: str) -> dict[str, Any]:
        """The manifest ``name``, read only if it is within MAX_MANIFEST_BYTES (it is the server's)."""
        size = self.store.size(name)
        if size > MAX_MANIFEST_BYTES:
            raise LimitExceeded(
                f"{name}: a manifest of {size} bytes, more than the {MAX_MANIFEST_BYTES} read"
            )
        raw = self.store.read_bytes(name, size)
        return parse_manifest(bytes(byte_view(raw.contiguous())), name)

    def close(self) -> None:
        self.store.close()

    def read(self, item: dict[str, Any]) -> torch.Tensor:
        """One item's tensor, checked against the manifest; VerificationFailed if it differs."""
        tensor = self.store.read(item["name"])
        value = checksum(ChecksumKind.XXH3_64, byte_view(tensor.contiguous()))
        same = list(tensor.shape) == item["shape"] and dtype_name(tensor.dtype) == item["dtype"]
        if f"{value:016x}" != item["xxh3"] or not same:
            raise VerificationFailed(f"{item['name']} differs from its manifest (hash, dtype or shape)")
        return tensor
