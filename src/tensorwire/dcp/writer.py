"""``StorageWriter``: torch.distributed.checkpoint (DCP) storage in a tensorwire store, so that
``dcp.save`` and ``dcp.async_save`` (and DCP's planners, resharding included) keep a checkpoint in a
server's memory instead of files; ``StorageReader`` (``reader.py``) reads it back for ``dcp.load``.

One checkpoint is one generation of the prefix ``<namespace>/<checkpoint_id>`` (docs/protocol.md
§14.8), published in ``P + 1`` parts under one transaction (P: the ranks that save): part ``r`` is
rank r's items, part ``P`` the coordinator's metadata. The server makes the generation visible
only once every part is in, so the metadata, sent last, is the commit: a save that fails or whose
rank dies before it (its connection closes: the server aborts the transaction) leaves nothing.

Writer lifecycle, in DCP's order (``torch.distributed.checkpoint.StorageWriter``):

0. ``reset(checkpoint_id)`` (when ``dcp.save`` is given one): a new id and save id. A part of a
   previous save still waiting (a save DCP gave up) is dropped with its connection.
1. ``set_up_storage_writer`` (all ranks): the client is opened here, on first use, not in
   ``__init__``: the writer pickles without it (``__getstate__``), as DCP's process-based
   ``async_save`` sends it to its checkpoint process.
2. ``prepare_local_plan`` (all ranks): the plan as it is.
3. ``prepare_global_plan`` (coordinator): the id reserved: refused (``CheckpointConflict``) if the
   prefix already holds a generation; a random 16-byte transaction id drawn and given to every
   rank's plan (``SavePart``), with its part's index.
4. ``write_data`` (all ranks): every item resolved (tensors to contiguous CPU, ``BytesIO`` as
   uint8), keyed ``r<rank>/<n>``, and sent as the rank's part on the writer's sender thread; the
   ``WriteResult``s (``StoredItem``: key, dtype, shape) are answered at once, since the part's
   answer only comes with the commit.
5. ``finish`` (coordinator): the metadata (JSON, ``dcp/metadata.py``) sent as the last part; it
   returns once the server published the generation, or raises what aborted it (a part that failed,
   a rank that died, ``timeout``): DCP raises it as ``CheckpointException`` on every rank. A commit
   that is not generation 1 (another save took the id meanwhile) is refused (``CheckpointConflict``)
   and never read: readers read generation 1.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.futures import Future

from tensorwire.dcp import metadata as md
from tensorwire.dcp.connection import (
    DEFAULT_NAMESPACE,
    DEFAULT_TIMEOUT,
    FIRST,
    Connection,
    checked_id,
    valid_id,
)
from tensorwire.errors import CheckpointConflict, InvalidTensor, KeyNotFound
from tensorwire.security import TlsFiles
from tensorwire.types import Generation
from tensorwire.wire import generations as wg


@dataclass(frozen=True, slots=True)
class SavePart:
    """What the coordinator gives each rank's plan (``SavePlan.storage_data``): the transaction,
    this rank's part index, and how many parts there are (the ranks' and the metadata's)."""

    txn: bytes
    index: int
    count: int


class StorageWriter(dcp_storage.StorageWriter):
    """DCP storage writer into the tensorwire server at ``url`` (module docstring): checkpoint
    ``checkpoint_id`` is generation 1 of ``<namespace>/<checkpoint_id>``. ``token``, ``tls`` and
    ``options`` (other ``ClientOptions`` fields) are the client's; ``timeout`` bounds each
    request and how long the parts of one save wait for each other on the server."""

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
    ) -> None:
        super().__init__()
        self._conn = Connection(url, checkpoint_id, token=token, tls=tls, namespace=namespace,
                                 timeout=timeout, options=options)  # fmt: skip
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        self.generation: Generation | None = None  # the last commit (coordinator)
        self._part: SavePart | None = None
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Generation] | None = None

    @property
    def checkpoint_id(self) -> str:
        return self._conn.checkpoint_id

    @property
    def prefix(self) -> str:
        return self._conn.prefix

    # 0 - 3: set-up and planning
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._abandon()
        if checkpoint_id:
            self._conn.checkpoint_id = checked_id(self._conn.namespace, checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "tensorwire.dcp.StorageWriter needs use_collectives=True: the ranks' parts and the"
                " coordinator's metadata commit together as one generation"
            )
        self._abandon()
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self._conn.client()  # opened now, so that a server out of reach fails this step

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._reserve()
        txn, count = os.urandom(wg.TXN_BYTES), len(plans) + 1
        return [dataclasses.replace(p, storage_data=SavePart(txn, i, count)) for i, p in enumerate(plans)]

    def _reserve(self) -> None:
        try:  # a read, not a manifest: shm:// serves reads of generations (views) but no manifest
            with self._conn.client().read_generation(self.prefix, "latest") as read:
                held = read.generation
        except KeyNotFound:
            return
        raise CheckpointConflict(
            f"checkpoint {self.checkpoint_id!r} already exists on {self._conn.url} (generation"
            f" {held.number} of {self.prefix!r}): a checkpoint id is saved once; drop it first"
            " (client.drop_generations) or save under another id"
        )

    # 4: this rank's items, as its part
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[dcp_storage.WriteResult]]:
        part = plan.storage_data
        if not isinstance(part, SavePart):
            raise InvalidTensor(
                "the plan carries no part of a tensorwire.dcp save (prepare_global_plan did not run)"
            )
        tensors: dict[str, torch.Tensor] = {}
        results: list[dcp_storage.WriteResult] = []
        for n, item in enumerate(plan.items):
            key = f"r{part.index}/{n}"
            tensor = _storable(planner.resolve_data(item), item.type)
            tensors[key] = tensor
            stored = md.StoredItem(key, tensor.dtype, tuple(tensor.shape))
            results.append(
                dcp_storage.WriteResult(index=item.index, size_in_bytes=stored.nbytes, storage_data=stored)
            )
        if not tensors:  # every part carries a tensor
            tensors[md.empty_key(part.index)] = torch.empty(0, dtype=torch.uint8)
        self._part = part
        self._pending = self._send(tensors, part.index, part)
        future: Future[list[dcp_storage.WriteResult]] = Future()
        future.set_result(results)
        return future

    # 5: the metadata, last: the commit
    def finish(self, metadata: Metadata, results: list[list[dcp_storage.WriteResult]]) -> None:
        part = self._part
        if part is None:
            raise InvalidTensor("finish before write_data: this rank sent no part")
        items = {r.index: r.storage_data for rank in results for r in rank}
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        metadata.storage_data = items
        try:
            doc = md.encode(metadata, items, checkpoint_id=self.checkpoint_id, parts=part.count)
            meta = torch.frombuffer(bytearray(doc), dtype=torch.uint8)
            generation = self._send({md.METADATA_KEY: meta}, part.count - 1, part).result()
            self._settle()
        except BaseException:
            self._abandon()  # its connection closed: the server aborts the transaction now
            raise
        self.generation = generation
        if generation.number != FIRST:
            raise CheckpointConflict(
                f"checkpoint {self.checkpoint_id!r} was committed by another save while this one ran"
                f" (this save is generation {generation.number} of {self.prefix!r}, which readers never read)"
            )

    def _send(
        self, tensors: dict[str, torch.Tensor], index: int, part: SavePart
    ) -> concurrent.futures.Future[Generation]:
        if self._sender is None:
            self._sender = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tensorwire-dcp")
        client = self._conn.client()
        return self._sender.submit(
            client.publish_part, self.prefix, tensors, txn=part.txn, index=index, count=part.count,
            timeout=self._conn.timeout,
        )  # fmt: skip

    def _settle(self) -> None:
        """This rank's own data part's answer (the coordinator's arrives with the commit)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result(self._conn.timeout)

    def _abandon(self) -> None:
        """Drop a part still waiting on the server (DCP gave its save up): closing its connection
        makes the server abort the transaction and free what it held."""
        pending, self._pending = self._pending, None
        self._part = None
        if pending is not None and not pending.done():
            self._conn.drop_client()
            with contextlib.suppress(Exception):
                pending.result(self._conn.timeout)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return valid_id(checkpoint_id)

    def close(self) -> None:
        """Drop a waiting part, close the client and the sender thread (a writer can still be used:
        it opens them again)."""
        self._abandon()
        self._conn.drop_client()
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.shutdown(wait=True)

    def __enter__(self) -> StorageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_sender=None, _pending=None, _part=None)
        return state


def _storable(data: Any, kind: WriteItemType) -> torch.Tensor:
    """A contiguous CPU tensor of a resolved item: a tensor's projection (copied only when it is
    not one already), or a ``BytesIO``'s bytes as uint8."""
    if kind == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise InvalidTensor(f"a byte item resolved to {type(data).__name__}, not io.BytesIO")
        raw = data.getbuffer().tobytes()
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
    if not isinstance(data, torch.Tensor):
        raise InvalidTensor(f"a tensor item resolved to {type(data).__name__}")
    return data.detach().to("cpu").contiguous()


__all__ = ["SavePart", "StorageWriter"]
