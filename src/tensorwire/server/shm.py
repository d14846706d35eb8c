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
committed, and the leases of views. When the connection ends, open puts are aborted (nothing of
them was ever visible) and leased segments are released *tainted*: the client may still read them
through a view, so they are never reused, only unlinked once the store frees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import struct
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tensorwire import topology, transport
from tensorwire.errors import InvalidTensor, LimitExceeded, ProtocolError, SharedMemoryUnavailable
from tensorwire.server.request import Extension, Handler, Request
from tensorwire.store import Reservation, TensorStore
from tensorwire.store.memory import Entry
from tensorwire.store.shm import SegmentPool, clean_stale
from tensorwire.transport.base import ByteStream, Listener
from tensorwire.types import Address
from tensorwire.wire import meta as wm
from tensorwire.wire import shm as ws
from tensorwire.wire.frame import Opcode

MAX_OPEN_PUTS = 64  # per connection: puts handed segments and not yet committed
MAX_LEASES = 65536  # per connection: tensors pinned by views
_U64 = struct.Struct("<Q")
_ids = itertools.count(1)


class ShmHost(Protocol):
    """What serving shm:// needs of the server (``core.Server`` is one)."""

    @property
    def store(self) -> TensorStore: ...

    async def handle(self, stream: ByteStream, transport: str = "tcp") -> None:
        """Serve one connection."""

    def extend(self, extension: Extension) -> None:
        """Add an extension to a starting server: its handlers join the table; it is closed with
        the server."""


# One service per server, made by its first shm:// listener.
_services: weakref.WeakKeyDictionary[ShmHost, ShmService] = weakref.WeakKeyDictionary()


class ShmSession:
    """One control connection's open puts and leases."""

    def __init__(self) -> None:
        self.attached = False
        self.service: ShmService | None = None
        self.puts: dict[int, Reservation] = {}
        self.leases: dict[int, list[Entry]] = {}
        self.leased = 0

    def close(self) -> None:
        service = self.service
        if service is None:
            return
        for res in self.puts.values():
            service.store.abort(res)
        for entries in self.leases.values():
            for entry in entries:  # a view may outlive its lease: never reuse what it reads
                segment = service.pool.segment_of(entry.data)
                if segment is not None:
                    segment.tainted = True
            service.store.release(entries)
        self.puts.clear()
        self.leases.clear()


class ShmService:
    """The segments, the probe and the SHM_* handlers of one server: an ``Extension``.

    Made by the first shm:// listener (it switches the store to segments), added to the server
    once that listener is up, closed by the server when it stops (or by ``listen`` when that first
    listener fails to start)."""

    def __init__(self, store: TensorStore, directory: Path) -> None:
        if not directory.is_dir() or not os.access(directory, os.W_OK):
            raise SharedMemoryUnavailable(f"cannot serve shm://: {directory} is not a writable directory")
        clean_stale(directory)  # what servers killed before their cleanup left behind
        self.store = store
        self.pool = SegmentPool(directory, self.store.pool_limit)
        self.token = int.from_bytes(os.urandom(8), "little")
        self.probe = self.pool.create_probe(_U64.pack(self.token))
        self.store.use_pool(self.pool)

    def frame_handlers(self) -> dict[int, Handler]:
        """The SHM_* handlers, each served only on the shm:// listener's connections (a tcp://
        listener of the same server answers them PROTOCOL_ERROR before anything happens)."""
        table: dict[int, Handler] = {
            Opcode.SHM_ATTACH: self.attach,
            Opcode.SHM_GET: self.get,
            Opcode.SHM_PUT: self.put,
            Opcode.SHM_COMMIT: self.commit,
            Opcode.SHM_RELEASE: self.release,
        }
        return {op: _shm_only(Opcode(op).name, handler) for op, handler in table.items()}

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
            inline, refs = self._split(entries)
            lease = 0
            if flags & ws.GET_LEASE and refs:
                if session.leased + len(refs) > MAX_LEASES:
                    raise LimitExceeded(f"this connection holds {session.leased} leases already")
                keep = [entries[ref.item] for ref in refs]
                lease = next(_ids)
                session.leases[lease] = keep
                session.leased += len(keep)
            meta = wm.encode_records([e.meta for e in inline]) + ws.encode_refs(refs) + _U64.pack(lease)
            await req.reply(meta, [e.data for e in inline])
        finally:
            kept = {id(e) for e in keep}
            self.store.release([e for e in entries if id(e) not in kept])

    def _split(self, entries: Sequence[Entry]) -> tuple[list[Entry], list[ws.SegmentRef]]:
        """The entries whose bytes travel inline, and references to those in segments."""
        inline, refs = [], []
        for i, entry in enumerate(entries):
            segment = self.pool.segment_of(entry.data)
            if segment is None:
                inline.append(entry)
            else:
                refs.append(ws.SegmentRef(i, entry.meta, segment.name, segment.generation))
        return inline, refs

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
        for put_id in puts:
            res = session.puts.pop(put_id, None)
            if res is not None:
                self.store.abort(res)
        await req.reply(b"")


def _shm_only(name: str, handler: Handler) -> Handler:
    """``handler``, refusing requests that did not come in on an shm:// listener: segments are for
    this host's clients, and a tcp:// (or tls://) connection of the same server may come from
    anywhere, so it may not reserve segments, pin them or learn the probe's token."""

    async def guarded(req: Request) -> None:
        if req.transport != "shm":
            raise ProtocolError(f"{name} is served only on the shm:// listener, not on {req.transport}://")
        await handler(req)

    return guarded


async def listen(server: ShmHost, address: Address) -> Listener:
    """Serve ``shm://HOST:PORT``: HOST must be a loopback address (only this host can map)."""
    if not topology.is_loopback(address.host):
        raise ValueError(f"cannot serve {address}: shared memory serves only this host; use 127.0.0.1")
    service = _services.get(server)
    first = service is None
    if service is None:
        service = ShmService(server.store, ws.shm_dir())
    try:
        # Counted in metrics as transport="shm": each transfer's path is visible, never a silent one.
        listener = await transport.listen(address, functools.partial(server.handle, transport="shm"))
    except BaseException:
        if first:
            await service.close()
        raise
    if first:  # before any connection is served: the listener accepts once this task yields
        _services[server] = service
        server.extend(service)
    return listener
