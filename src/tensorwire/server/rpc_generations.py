"""Generations over gRPC (docs/protocol.md §14.9): the calls of ``TensorService`` that
``tensorwire.sharded`` puts and reads with, on the same objects as the frame protocol's opcodes
(generation_ops.py, generation_parts.py), so both faces of a server share one set of
generations and one set of open transactions.

* ``PublishPart`` (GEN_PUBLISH_PART): the call's first chunk names its transaction, which the part
  joins (every bound checked) before a byte is reserved; its tensors are then received like a
  ``Put`` (capacity reserved per tensor, each chunk's checksum verified before it is kept) and
  held in the transaction; the call is answered when the transaction commits or aborts. The call
  is the part's owner: a call that ends first (cancelled, its connection gone) aborts its
  transaction, as a closed connection does on the frame side.
* ``GetRanges`` (GEN_GET_RANGES): many byte ranges of one tensor of one generation, pinned while
  they stream, answered like a ``Get``.
* ``Manifest`` (GEN_MANIFEST) and ``Lease`` (GEN_LEASE). A gRPC server sees calls, not
  connections: a lease belongs to the calling peer (its address, one per HTTP/2 connection),
  bounded per peer as per connection on the frame side, per client host with the frame side's
  leases (``leases_per_client``: a client that reconnects between leases gets no more), and the
  peers holding one by the server's ``--max-connections``, since a lease outlives its connection:
  it ends when it runs out (``--max-lease-seconds``) or is released. A manifest's answer, and the
  copy of each GetRanges message, count against the capacity until grpcio has sent them
  (``TensorStore.hold``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire.errors import KeyNotFound, LimitExceeded, ProtocolError, TensorwireError
from tensorwire.server.generation_ops import GenerationOps
from tensorwire.server.rpc_calls import (
    StreamedPut,
    Watchdog,
    abort,
    answer,
    checked_chunk,
    off_loop,
    read_options,
)
from tensorwire.store import Reservation
from tensorwire.store.generations import Kept
from tensorwire.store.uploads import client_of
from tensorwire.types import Limits, TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire import generations as wg
from tensorwire.wire.rpc import (
    decode_chunk,
    generation_info,
    info_of,
    manifest_reply,
    part_head,
)


@dataclass(eq=False)
class _Peer:
    """One gRPC peer's leases: the owner ``Generations`` keys them by, and their end timers."""

    name: str
    client: str  # its host (``client_of``), whose quota its leases count against
    timers: dict[tuple[str, int], asyncio.TimerHandle] = field(default_factory=dict)


class GenerationCalls:
    """The generation calls of ``TensorService`` (module docstring), on one server's generations."""

    def __init__(self, ops: GenerationOps, limits: Limits, stall_timeout: float, max_peers: int) -> None:
        self.generations = ops.generations
        self.parts = ops.parts
        self.store = ops.generations.store
        self.limits = limits
        self.stall_timeout = stall_timeout
        self._peers: dict[str, _Peer] = {}  # peers holding a lease
        # A peer's leases outlive its connection (they run out at their time): without this bound
        # a client that reconnects between leases would hold leases_per_owner more each time.
        self.max_peers = max_peers

    # -- PublishPart ----------------------------------------------------------------------------
    async def PublishPart(self, chunks: AsyncIterator[bytes], context: Any) -> pb.GenerationInfo:
        client = client_of(str(context.peer()))
        return await answer(context, lambda: self._publish_part(chunks, client))

    async def _publish_part(self, chunks: AsyncIterator[bytes], client: str) -> pb.GenerationInfo:
        held = self.parts.owner("call", client)
        batch = Reservation()
        watchdog = Watchdog(self.stall_timeout)
        try:
            stream = chunks.__aiter__()
            first = await anext(stream, None)
            info = decode_chunk(first).part if first is not None else None
            if first is None or info is None:
                raise ProtocolError("a PublishPart's first chunk carries no part head")
            head = part_head(info)
            txn = self.parts.join(held, head)  # every bound, before a byte is reserved
            error: TensorwireError | None = None
            try:
                await StreamedPut(self.store, self.limits, batch, watchdog).receive(_chained(first, stream))
            except TensorwireError as exc:  # a corrupt chunk, a full store, a call cut off midway
                error = exc  # (grpcio ends its stream early): the part failed, and so its transaction
            watchdog.close()  # from here the transaction's own timeout bounds the wait
            await self.parts.add(txn, head, batch, error)
            return generation_info(await self.parts.outcome(txn))
        except asyncio.CancelledError:
            if not watchdog.fired:
                raise  # the call was cancelled: ``held.close`` below aborts its transaction
            raise watchdog.cut_off() from None
        finally:
            watchdog.close()
            held.close()  # a call that ends before its transaction (cancelled, cut off) aborts it
            self.store.abort(batch)  # a no-op once the transaction has ended (merged it, or freed it)

    # -- GetRanges ------------------------------------------------------------------------------
    async def GetRanges(self, request: pb.RangesRequest, context: Any) -> AsyncIterator[bytes]:
        """The ranges' bytes as raw ``Chunk`` messages; a reader that stops reading for the stall
        timeout is cut off and the generation unpinned."""
        ranges = await self._ranges(request, context)
        chunk, kind = await read_options(request, self.limits, context)
        kept, meta, data = await self._pinned(request.name, request.at, ranges, context)
        watchdog = Watchdog(self.stall_timeout)
        release: Callable[[], None] | None = None
        try:
            total = sum(n for _, n in ranges)
            record = TensorMeta(meta.name, torch.uint8, (total,), total, meta.version)
            yield pb.Chunk(manifest=[info_of(record)]).SerializeToString()
            for pieces in _cut(data, ranges, chunk):
                watchdog.progress()
                size = sum(p.nbytes for p in pieces)
                if release is not None:
                    release()  # the previous message was taken: grpcio asks for the next one
                release = await self._hold(size, context)  # its copy, until grpcio has sent it
                yield await off_loop(size, _joined_chunk, pieces, kind)
        finally:
            if release is not None:
                release()
            watchdog.close()
            self.generations.unpin(kept)

    async def _hold(self, nbytes: int, context: Any) -> Callable[[], None]:
        """``nbytes`` of an answer counted against the capacity (the call is refused, naming
        --capacity, where there is no room)."""
        try:
            return self.store.hold(nbytes)
        except TensorwireError as exc:
            await abort(context, exc)
            raise

    async def _ranges(self, request: pb.RangesRequest, context: Any) -> list[tuple[int, int]]:
        """The request's ranges, counted and summed against the limits before any is used."""
        count = len(request.offsets)
        if not count or count > wg.MAX_RANGES or len(request.lengths) != count:
            why = f"{count} offsets and {len(request.lengths)} lengths"
            await abort(context, ProtocolError(f"a GetRanges of {why}: 1 to {wg.MAX_RANGES} of each"))
        total = sum(request.lengths)
        if total > self.limits.max_request_bytes:
            await abort(
                context, LimitExceeded(f"an answer of {total} bytes exceeds {self.limits.max_request_bytes}")
            )
        return list(zip(request.offsets, request.lengths, strict=True))

    async def _pinned(
        self, name: str, at: int, ranges: Sequence[tuple[int, int]], context: Any
    ) -> tuple[Kept, TensorMeta, memoryview]:
        """Generation ``at`` pinned, with ``name``'s record and bytes, every range inside them."""
        try:
            kept = self.generations.pin(self.generations.prefix_of([name]), at)
        except TensorwireError as exc:
            await abort(context, exc)
            raise
        try:
            pair = kept.tensors.get(name)
            if pair is None:
                gen = kept.generation
                raise KeyNotFound(f"generation {gen.number} of {gen.prefix!r} has no tensor {name!r}")
            for offset, length in ranges:
                wg.check_range(pair[0], offset, length)
        except TensorwireError as exc:
            self.generations.unpin(kept)
            await abort(context, exc)
            raise
        return kept, pair[0], pair[1]

    # -- Manifest and Lease ---------------------------------------------------------------------
    async def Manifest(self, request: pb.ManifestRequest, context: Any) -> pb.ManifestReply:
        async def run() -> pb.ManifestReply:
            manifest = self.generations.manifest(self.generations.find(request.prefix, request.at))
            # Built in a worker thread for a generation of many tensors (the manifest is a copy:
            # nothing of the store is read there).
            reply = await off_loop(len(manifest.tensors) * 1024, manifest_reply, manifest)
            # grpcio keeps the answer (and its serialized copy) until the peer has read it.
            release = self.store.hold(2 * reply.ByteSize())
            context.add_done_callback(lambda _: release())
            return reply

        return await answer(context, run)

    async def Lease(self, request: pb.LeaseRequest, context: Any) -> pb.LeaseReply:
        async def run() -> pb.LeaseReply:
            peer = str(context.peer())
            return self._lease(peer, request.prefix, request.number, request.milliseconds)

        return await answer(context, run)

    def _lease(self, name: str, prefix: str, number: int, ms: int) -> pb.LeaseReply:
        peer = self._peers.get(name)
        if peer is None:
            if ms and len(self._peers) >= self.max_peers:
                raise LimitExceeded(f"{len(self._peers)} gRPC peers hold leases on this server: at most"
                                    f" {self.max_peers} (--max-connections)")  # fmt: skip
            peer = _Peer(name, client_of(name))
        granted, oldest = self.generations.lease(peer, prefix, number, ms / 1000, client=peer.client)
        timer = peer.timers.pop((prefix, number), None)
        if timer is not None:
            timer.cancel()
        if granted:  # retire it when the lease runs out (a renewal replaces the timer)
            later = asyncio.get_running_loop().call_later(
                granted + 0.01, functools.partial(self._lease_ended, peer, prefix, number)
            )
            peer.timers[(prefix, number)] = later
        self._forget_idle(peer)
        return pb.LeaseReply(granted_ms=round(granted * 1000), oldest=oldest)

    def _lease_ended(self, peer: _Peer, prefix: str, number: int) -> None:
        peer.timers.pop((prefix, number), None)
        self.generations.lease(peer, prefix, number, 0.0)  # released: it ran out
        self._forget_idle(peer)

    def _forget_idle(self, peer: _Peer) -> None:
        """Remember a peer only while it holds a lease (the table stays as small as the leases)."""
        if peer.timers:
            self._peers[peer.name] = peer
        else:
            self._peers.pop(peer.name, None)
            self.generations.drop_owner(peer)


async def _chained(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for raw in rest:
        yield raw


def _cut(data: memoryview, ranges: Sequence[tuple[int, int]], chunk: int) -> list[list[memoryview]]:
    """The ranges' bytes of ``data``, in order, as lists of views of at most ``chunk`` bytes in
    all (small ranges share a message; a large one is cut)."""
    out: list[list[memoryview]] = []
    pieces: list[memoryview] = []
    size = 0
    for offset, length in ranges:
        pos = offset
        while pos < offset + length:
            take = min(offset + length - pos, chunk - size)
            pieces.append(data[pos : pos + take])
            pos, size = pos + take, size + take
            if size == chunk:
                out.append(pieces)
                pieces, size = [], 0
    if pieces:
        out.append(pieces)
    return out


def _joined_chunk(pieces: list[memoryview], kind: int) -> bytes:
    joined = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
    return checked_chunk(joined, kind)
