"""``StorageReader``: a torch.distributed.checkpoint (DCP) checkpoint read back from a tensorwire
store, for ``dcp.load`` (and DCP's planners, resharding included). A checkpoint is generation 1 of
the prefix ``<namespace>/<checkpoint_id>``, published by ``StorageWriter`` (``writer.py``: how its
parts commit together).

``read_metadata`` reads generation 1's ``_metadata`` (``KeyNotFound``: no committed
checkpoint of that id), decodes it as untrusted JSON and checks every item against the tensors the
generation holds, all before DCP plans; ``read_data`` reads, of each stored chunk, only the byte
runs a ``ReadItem`` asks for (``storage_offsets``, ``lengths``), many in flight, straight into the
destination when it is a contiguous CPU tensor. Byte items are handed to the planner (whose
default ``load_bytes`` is ``torch.load(weights_only=False)``) only after they load under
``torch.load(weights_only=True)`` (``weights_only=False`` on the reader turns that check off).
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from tensorwire.client.ranges import GenerationRead, RangeRead
from tensorwire.dcp import metadata as md
from tensorwire.dcp.connection import (
    DEFAULT_NAMESPACE,
    DEFAULT_TIMEOUT,
    FIRST,
    Connection,
    checked_id,
    valid_id,
)
from tensorwire.errors import (
    CheckpointConflict,
    GenerationRetired,
    InvalidTensor,
    KeyNotFound,
    LayoutMismatch,
)
from tensorwire.security import TlsFiles
from tensorwire.sharded.layout import Box, overlap_runs
from tensorwire.wire.tensors import byte_view


class StorageReader(dcp_storage.StorageReader):
    """DCP storage reader of checkpoint ``checkpoint_id`` in the tensorwire server at ``url``
    (module docstring); the options are ``StorageWriter``'s. ``weights_only``: a byte item reaches
    the planner only if ``torch.load(weights_only=True)`` loads it."""

    def __init__(
        self,
        url: str,
        checkpoint_id: str | os.PathLike[str],
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        timeout: float = DEFAULT_TIMEOUT,
        options: Mapping[str, Any] | None = None,
        weights_only: bool = True,
    ) -> None:
        super().__init__()
        self._conn = Connection(url, checkpoint_id, token=token, tls=tls, namespace=namespace,
                                 timeout=timeout, options=options)  # fmt: skip
        self.weights_only = weights_only
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, md.StoredItem] = {}
        self._digest: bytes | None = None  # the generation read_metadata checked

    @property
    def checkpoint_id(self) -> str:
        return self._conn.checkpoint_id

    @property
    def prefix(self) -> str:
        return self._conn.prefix

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._conn.checkpoint_id = checked_id(self._conn.namespace, checkpoint_id)
        self.storage_data, self._digest = {}, None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self._open() as read:
            metadata, items = self._decode(read)
            self._digest = read.generation.digest
        self.storage_data = items
        assert metadata.storage_meta is not None  # decode always sets it
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _decode(self, read: GenerationRead) -> tuple[Metadata, dict[MetadataIndex, md.StoredItem]]:
        name = f"{self.prefix}/{md.METADATA_KEY}"
        meta = read.metas.get(name)
        if meta is None:
            raise KeyNotFound(self._missing("its generation holds no _metadata"))
        if meta.dtype != torch.uint8 or len(meta.shape) != 1 or meta.nbytes > md.MAX_DOCUMENT_BYTES:
            raise LayoutMismatch(f"{name!r} is {meta.dtype} {list(meta.shape)}, not checkpoint metadata")
        data = torch.empty(meta.nbytes, dtype=torch.uint8)
        read.read([RangeRead(name, 0, byte_view(data))])
        metadata, items, parts = md.decode(data.numpy().tobytes(), checkpoint_id=self.checkpoint_id)
        md.check_stored(items, read.metas, self.prefix, parts)
        return metadata, items

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._digest is None or metadata.storage_data is not self.storage_data:
            raise InvalidTensor(
                "set_up_storage_reader takes the Metadata this reader's read_metadata returned"
            )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        tensor_items = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
        byte_items = [r for r in plan.items if r.type == LoadItemType.BYTE_IO]
        with self._open() as read:
            if read.generation.digest != self._digest:
                raise CheckpointConflict(
                    f"checkpoint {self.checkpoint_id!r} changed since its metadata was read"
                )
            landings = [self._landing(req, planner) for req in tensor_items]  # checks every item first
            blobs = [self._blob(req) for req in byte_items]
            read.read([r for _, _, r in blobs])  # byte items first: checked before any tensor is filled
            checked = [(req, self._checked_bytes(req, data)) for req, data, _ in blobs]
            read.read([r for landing in landings for r in landing.reads])
        for landing in landings:
            landing.land(planner)
        for req, value in checked:
            planner.load_bytes(req, value)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open(self) -> GenerationRead:
        try:
            return self._conn.client().read_generation(self.prefix, FIRST)
        except (KeyNotFound, GenerationRetired) as exc:
            raise KeyNotFound(self._missing(str(exc))) from exc

    def _missing(self, why: str) -> str:
        return (
            f"checkpoint {self.checkpoint_id!r} has no committed metadata on {self._conn.url} ({why}):"
            " it was never saved, or its save did not finish"
        )

    def _item(self, req: ReadItem) -> md.StoredItem:
        item = self.storage_data.get(req.storage_index)
        if item is None:
            raise LayoutMismatch(
                f"{req.storage_index.fqn!r}: the plan reads a chunk the checkpoint does not hold"
            )
        return item

    def _landing(self, req: ReadItem, planner: LoadPlanner) -> _Landing:
        item = self._item(req)
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        wanted = Box(offsets, lengths)
        if (
            len(offsets) != len(item.shape)
            or len(lengths) != len(item.shape)
            or any(o < 0 or o + n > s for o, n, s in zip(offsets, lengths, item.shape, strict=True))
        ):
            raise LayoutMismatch(
                f"{req.storage_index.fqn!r}: the plan reads {wanted} of a chunk of {list(item.shape)}"
            )
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != lengths or target.dtype != item.dtype:
            raise LayoutMismatch(
                f"{req.dest_index.fqn!r}: {wanted} of a {item.dtype} chunk read into"
                f" {target.dtype} {list(target.shape)}"
            )
        direct = target.device.type == "cpu" and target.is_contiguous()
        buffer = target if direct else torch.empty(lengths, dtype=target.dtype)
        dest = byte_view(buffer)
        name = f"{self.prefix}/{item.key}"
        whole = Box((0,) * len(item.shape), item.shape)
        reads = [
            RangeRead(name, src, dest[dst : dst + n])
            for src, dst, n in overlap_runs(whole, wanted, item.dtype.itemsize)
        ]
        return _Landing(req, target, buffer, reads)

    def _blob(self, req: ReadItem) -> tuple[ReadItem, torch.Tensor, RangeRead]:
        item = self._item(req)
        data = torch.empty(item.nbytes, dtype=torch.uint8)
        return req, data, RangeRead(f"{self.prefix}/{item.key}", 0, byte_view(data))

    def _checked_bytes(self, req: ReadItem, data: torch.Tensor) -> io.BytesIO:
        raw = data.numpy().tobytes()
        if self.weights_only:
            try:
                torch.load(io.BytesIO(raw), weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
                raise LayoutMismatch(
                    f"{req.storage_index.fqn!r}: its bytes do not load with torch.load(weights_only=True),"
                    " so they are not handed to the planner (StorageReader(weights_only=False)"
                    f" trusts them): {exc}"
                ) from exc
        return io.BytesIO(raw)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return valid_id(checkpoint_id)

    def close(self) -> None:
        self._conn.drop_client()

    def __enter__(self) -> StorageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Landing:
    """One ReadItem's reads: into the destination itself, or into ``buffer`` copied over after."""

    req: ReadItem
    target: torch.Tensor
    buffer: torch.Tensor
    reads: list[RangeRead]

    def land(self, planner: LoadPlanner) -> None:
        if self.buffer is not self.target:
            self.target.copy_(self.buffer)
        planner.commit_tensor(self.req, self.target)


__all__ = ["StorageReader"]
