"""The server side of ``shm://``: the store's tensors in shared-memory segments that clients map.

Serving ``shm://HOST:PORT`` (HOST a loopback address) starts a TCP listener for the control
connection (the frame protocol, with the SHM_* opcodes of docs/protocol.md §12 on top of the
usual ones) and switches the server's store to a ``SegmentPool``: from then on every tensor of 64
KiB or more lives in a segment of its own. The control messages carry names, records and segment
references; the bytes of a segment never cross the socket.

It is an ``Extension`` (request.py) the first shm:// listener adds to its server
(``Server.extend``): its SHM_* handlers join the server's opcode table, each refusing requests that
did not come in on an shm:// listener, and the server closes it when it stops.

Per connection (``ShmSession``) the server keeps the puts it handed segments out for and not yet
committed (SHM_COMMIT publishes one as named tensors; SHM_GEN_PART hands one to a multi-part
publish, generation_parts.py, once its chunk checksums are checked), and the leases of views: of
named tensors (SHM_GET) and of whole generations (SHM_GEN_VIEW, §16: the generation stays pinned,
so it is never freed, whatever ``--keep-generations`` retires, while the lease lives, which is at
most ``--max-lease-seconds``: a reader that keeps its views longer cannot hold the store's room
with them). When the connection ends, open puts are aborted (nothing of them was ever visible) and
leased segments are released *tainted*: the client may still read them through a view, so they
are never reused, only unlinked once the store frees them; so is a view's generation when its
lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tensorwire import transport
from tensorwire.errors import InvalidTensor, LimitExceeded, ProtocolError, SharedMemoryUnavailable
from tensorwire.logs import event
from tensorwire.security import is_loopback
from tensorwire.server.generation_parts import PartPublishes
from tensorwire.server.request import Extension, Handler, Request, extension_of, listener_only
from tensorwire.store import Reservation, TensorStore
from tensorwire.store.generations import Generations, Kept
from tensorwire.store.memory import Entry
from tensorwire.store.shm import SegmentPool, clean_stale
from tensorwire.transport.base import ByteStream, Listener
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire import shm as ws
from tensorwire.wire.frame import Opcode

MAX_OPEN_PUTS = 64  # per connection: puts handed segments and not yet committed
MAX_LEASES = 65536  # per connection: tensors pinned by views
log = logging.getLogger("tensorwire.server.shm")
_U64 = struct.Struct("<Q")
_ids = itertools.count(1)


class ShmHost(Protocol):
    """What serving shm:// needs of the server (``core.Server`` is one)."""

    @property
    def store(self) -> TensorStore: ...

    @property
    def generations(self) -> Generations: ...

    @property
    def part_publishes(self) -> PartPublishes: ...

    @property
    def extensions(self) -> Sequence[Extension]: ...

    async def handle(self, stream: ByteStream, transport: str = "tcp") -> None:
        """Serve one connection."""

    def extend(self, extension: Extension) -> None:
        """Add an extension to a starting server: its handlers join the table; it is closed with
        the server."""


class ShmSession:
    """One control connection's open puts and leases."""

    def __init__(self) -> None:
        self.attached = False
        self.service: ShmService | None = None
        self.puts: dict[int, Reservation] = {}
        self.leases: dict[int, list[Entry]] = {}
        self.leased = 0
        self.views: dict[int, Kept] = {}  # lease -> the generation it pins (SHM_GEN_VIEW)
        self.view_ends: dict[int, asyncio.TimerHandle] = {}  # lease -> when it runs out

    def close(self) -> None:
        service = self.service
        if service is None:
            return
        for res in self.puts.values():
            service.store.abort(res)
        # A view may outlive its lease: never reuse what it reads.
        for entries in self.leases.values():
            service.taint(entry.data for entry in entries)
            service.store.release(entries)
        for lease in list(self.views):
            self.end_view(lease, taint=True)
        self.puts.clear()
        self.leases.clear()

    def end_view(self, lease: int, *, taint: bool) -> bool:
        """View ``lease`` ends (released, its connection closed, or run out): its generation is
        unpinned; with ``taint`` (the client may still read it: not released) its segments are never
        reused. Whether it was held."""
        service, kept = self.service, self.views.pop(lease, None)
        timer = self.view_ends.pop(lease, None)
        if timer is not None:
            timer.cancel()
        if service is None or kept is None:
            return False
        if taint:
            service.taint(data for _, data in kept.tensors.values())
        service.generations.unpin(kept)
        return True


class ShmService:
    """The segments, the probe and the SHM_* handlers of one server: an ``Extension``.

    Made by the first shm:// listener (it switches the store to segments), added to the server
    once that listener is up, closed by the server when it stops (or by ``listen`` when that first
    listener fails to start)."""

    def __init__(
        self, store: TensorStore, directory: Path, generations: Generations, parts: PartPublishes
    ) -> None:
        if not directory.is_dir() or not os.access(directory, os.W_OK):
            raise SharedMemoryUnavailable(f"cannot serve shm://: {directory} is not a writable directory")
        clean_stale(directory)  # what servers killed before their cleanup left behind
        self.store = store
        self.generations = generations
        self.parts = parts
        self.pool = SegmentPool(directory, self.store.pool_limit)
        self.token = int.from_bytes(os.urandom(8), "little")
        self.probe = self.pool.create_probe(_U64.pack(self.token))
        self.store.use_pool(self.pool)
        self.views_expired = 0  # generation views whose lease ran out (--max-lease-seconds)

    def frame_handlers(self) -> dict[int, Handler]:
        """The SHM_* handlers, each served only on the shm:// listener's connections (a tcp://
        listener of the same server answers them PROTOCOL_ERROR before anything happens)."""
        table: dict[int, Handler] = {
            Opcode.SHM_ATTACH: self.attach,
            Opcode.SHM_GET: self.get,
            Opcode.SHM_PUT: self.put,
            Opcode.SHM_COMMIT: self.commit,
            Opcode.SHM_RELEASE: self.release,
            Opcode.SHM_GEN_VIEW: self.view,
            Opcode.SHM_GEN_PART: self.publish_part,
        }
        return listener_only("shm", table)

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    async def close(self) -> None:
        """The server stops (its listeners are closed): remove the probe and the segments."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.probe)
        self.pool.close()

    def session(self, req: Request) -> ShmSession:
        session = req.session_state(ShmSession)
        if not session.attached:
            raise ProtocolError("SHM_ATTACH must come before the other SHM_* requests")
        return session

    # -- handlers ----------------------------------------------------------------------------------
    async def attach(self, req: Request) -> None:
        req.meta.done()
        session = req.session_state(ShmSession)
        session.attached, session.service = True, self
        await req.reply(wm.encode_names([self.probe.name])[4:] + _U64.pack(self.token))

    async def get(self, req: Request) -> None:
        session = self.session(req)
        flags = req.meta.u8()
        names = wm.decode_names(req.meta)
        req.meta.done()
        if not names or len(set(names)) != len(names):
            raise ProtocolError("SHM_GET names no tensor, or one tensor twice")
        entries = self.store.acquire(names)
        keep: list[Entry] = []  # pinned by a lease, past this request
        try:
            slots, refs = self._split([(e.meta, e.data) for e in entries])
            inline = [entries[i] for i in slots]
            lease = 0
            if flags & ws.GET_LEASE and refs:
                if session.leased + len(refs) > MAX_LEASES:
                    raise LimitExceeded(f"this connection holds {session.leased} leases already")
                keep = [entries[ref.item] for ref in refs]
                lease = next(_ids)
                session.leases[lease] = keep
                session.leased += len(keep)
            meta = wm.encode_records([e.meta for e in inline]) + ws.encode_refs(refs) + _U64.pack(lease)
            await req.reply(meta, [e.payload for e in inline])
        finally:
            kept = {id(e) for e in keep}
            self.store.release([e for e in entries if id(e) not in kept])

    def _split(
        self, tensors: Sequence[tuple[TensorMeta, memoryview]]
    ) -> tuple[list[int], list[ws.SegmentRef]]:
        """The indexes of the tensors whose bytes travel inline, and references to those in segments."""
        inline, refs = [], []
        for i, (meta, data) in enumerate(tensors):
            segment = self.pool.segment_of(data)
            if segment is None:
                inline.append(i)
            else:
                refs.append(ws.SegmentRef(i, meta, segment.name, segment.generation))
        return inline, refs

    def taint(self, buffers: Iterable[memoryview]) -> None:
        """The segments of ``buffers`` may be read by views whose lease is gone: never reuse them."""
        for data in buffers:
            segment = self.pool.segment_of(data)
            if segment is not None:
                segment.tainted = True

    async def view(self, req: Request) -> None:
        """SHM_GEN_VIEW: every tensor of one generation, where it lies; its segments stay pinned
        under one lease (docs/protocol.md §16) until SHM_RELEASE names it or the connection ends."""
        session = self.session(req)
        prefix, at = ws.decode_view_request(req.meta)
        req.meta.done()
        kept = self.generations.pin(prefix, at)
        lease = 0
        try:
            gen = kept.generation
            tensors = [kept.tensors[name] for name in gen.names]
            slots, refs = self._split(tensors)
            if refs:
                limits = self.generations.config  # a view holds its generation as a lease does
                if len(session.views) >= limits.leases_per_owner:
                    pinned = f"this connection pins {len(session.views)} generations with views"
                    raise LimitExceeded(f"{pinned}: {limits.most('leases_per_owner')}")
                lease = next(_ids)
                session.views[lease] = kept
                self._expire_later(session, lease, prefix, gen.number)
            meta = ws.encode_view_answer(gen, [tensors[i][0] for i in slots], refs, lease)
            await req.reply(meta, [tensors[i][1] for i in slots])
        except BaseException:
            session.views.pop(lease, None)  # the client never learnt the lease: nothing reads it
            timer = session.view_ends.pop(lease, None)
            if timer is not None:
                timer.cancel()
            lease = 0
            raise
        finally:
            if not lease:
                self.generations.unpin(kept)

    def _expire_later(self, session: ShmSession, lease: int, prefix: str, number: int) -> None:
        """View ``lease`` ends after ``--max-lease-seconds`` as a lease on a generation does, so a
        reader cannot keep generations (and the store's room) pinned for ever by keeping views."""
        seconds = self.generations.config.max_lease_seconds
        loop = asyncio.get_running_loop()
        session.view_ends[lease] = loop.call_later(seconds, self._expire, session, lease, prefix, number)

    def _expire(self, session: ShmSession, lease: int, prefix: str, number: int) -> None:
        session.view_ends.pop(lease, None)
        if session.end_view(lease, taint=True):
            self.views_expired += 1
            event(log, logging.INFO, "generation view ran out (--max-lease-seconds): unpinned; its views"
                  " read on", prefix=prefix, generation=number, expired=self.views_expired)  # fmt: skip

    async def put(self, req: Request) -> None:
        session = self.session(req)
        metas = wm.decode_records(req.meta)
        req.meta.done()
        if not metas:
            raise ProtocolError("SHM_PUT carries no tensors")
        if len(session.puts) >= MAX_OPEN_PUTS:
            raise LimitExceeded(f"{MAX_OPEN_PUTS} puts are open on this connection already")
        res = self.store.reserve(metas)
        refs = []
        for i, (meta, buf) in enumerate(zip(res.metas, res.buffers, strict=True)):
            segment = self.pool.segment_of(buf)
            if segment is not None:
                refs.append(ws.SegmentRef(i, meta, segment.name, segment.generation))
        put_id = next(_ids)
        session.puts[put_id] = res
        await req.reply(_U64.pack(put_id) + ws.encode_refs(refs))

    async def commit(self, req: Request) -> None:
        session = self.session(req)
        put_id = req.meta.u64()
        inline = wm.decode_records(req.meta)
        req.meta.done()
        res = session.puts.pop(put_id, None)
        if res is None:
            raise ProtocolError(f"SHM_COMMIT of put {put_id}, which this connection does not hold open")
        try:
            buffers = self._inline_buffers(res, inline)
            if sum(b.nbytes for b in buffers) != req.header.data_len:
                raise InvalidTensor("the inline records' sizes do not add up to the frame's data length")
            await req.receive(buffers)  # every chunk verified
            version = await self._commit(req, res)
        except BaseException:
            self.store.abort(res)  # a no-op once the commit has begun
            raise
        await req.reply(_U64.pack(version))

    async def publish_part(self, req: Request) -> None:
        """SHM_GEN_PART: an open put of this connection (SHM_PUT; its segments written by the
        client) becomes part ``index`` of a multi-part publish (§14.8). Its inline tensors are
        received and verified as SHM_COMMIT's; the part counts once every chunk checksum the
        server computes from the bytes matches the one the request gives (``PartPublishes``)."""
        session = self.session(req)
        head, put_id = wg.decode_shm_part(req.meta)
        res = session.puts.pop(put_id, None)
        if res is None:
            raise ProtocolError(f"SHM_GEN_PART of put {put_id}, which this connection does not hold open")
        try:
            sums = wg.decode_part_sums(req.meta, [m.nbytes for m in res.metas])
            buffers = self._inline_buffers(res, wm.decode_records(req.meta))
            req.meta.done()
            if sum(b.nbytes for b in buffers) != req.header.data_len:
                raise InvalidTensor("the inline records' sizes do not add up to the frame's data length")
            await req.receive(buffers)  # every chunk verified
        except BaseException:
            self.store.abort(res)
            raise
        await self.parts.publish_reserved(req, head, res, sums)  # owns ``res`` from here

    def _inline_buffers(self, res: Reservation, inline: Sequence[object]) -> list[memoryview]:
        """The reservation's private buffers, which the commit's records must describe in order."""
        pairs = [
            (m, b) for m, b in zip(res.metas, res.buffers, strict=True) if self.pool.segment_of(b) is None
        ]
        if [m for m, _ in pairs] != list(inline):
            raise ProtocolError("SHM_COMMIT's inline records are not those of the put it commits")
        return [b for _, b in pairs]

    async def _commit(self, req: Request, res: Reservation) -> int:
        if not self.store.persistent:
            return self.store.commit(res)
        with req.waiting():  # the disk write blocks: keep the loop serving the others
            return await asyncio.get_running_loop().run_in_executor(None, self.store.commit, res)

    async def release(self, req: Request) -> None:
        session = self.session(req)
        leases, puts = ws.decode_release(req.meta)
        for lease in leases:
            entries = session.leases.pop(lease, [])
            session.leased -= len(entries)
            self.store.release(entries)
            session.end_view(lease, taint=False)  # the client's views of it are gone
        for put_id in puts:
            res = session.puts.pop(put_id, None)
            if res is not None:
                self.store.abort(res)
        await req.reply(b"")


async def listen(server: ShmHost, address: Address) -> Listener:
    """Serve ``shm://HOST:PORT``: HOST must be a loopback address (only this host can map)."""
    if not is_loopback(address.host):
        raise ValueError(f"cannot serve {address}: shared memory serves only this host; use 127.0.0.1")
    service = extension_of(server.extensions, ShmService)  # one per server, made by its first shm://
    first = service is None
    if service is None:
        service = ShmService(server.store, ws.shm_dir(), server.generations, server.part_publishes)
    try:
        # Counted in metrics as transport="shm": each transfer's path is visible, never a silent one.
        listener = await transport.listen(address, functools.partial(server.handle, transport="shm"))
    except BaseException:
        if first:
            await service.close()
        raise
    if first:  # before any connection is served: the listener accepts once this task yields
        server.extend(service)
    return listener
