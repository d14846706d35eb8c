"""Serving ``rdma://``: the frame protocol for control, the transfer engine for the bytes.

Serving ``rdma://HOST:PORT`` starts a TCP listener for the control connection (HELLO with the
token, names, records, versions, commits and errors: the frame protocol, with the RDMA_* opcodes
of docs/protocol.md §17 on top of the usual ones) and one transfer engine for the server process
(``transport/rdma_engine.py``). The bytes of large tensors move one-sided through the engine:

* a put: RDMA_PUT reserves the tensors in the store (counted against its capacity) and registers
  the reserved buffers with the engine; the client writes into them; RDMA_END (commit) carries
  the checksum of every chunk: the server unregisters the buffers (no write can land after that),
  checks every chunk against the bytes actually there, and only then stores them.
* a get: RDMA_GET copies each stored tensor into a buffer of its own (a registered buffer is
  writable by any engine peer, so stored bytes are never registered), registers it, and answers
  with its address and chunk checksums; the client reads and checks; RDMA_END (release) frees it.

The engine authenticates no one and hands any peer the addresses of whatever is registered
(README, "RDMA"), and its ports accept any connection: they are kept to the interface asked for,
and at most ``--max-connections`` connections to them stay open (``rdma_engine``; those shut
down are counted as refused connections, reasons ``rdma_limit`` and ``rdma_silent``). So the
server registers only buffers reserved for an authenticated request on an rdma:// listener's
connection, for that request's lifetime: at most ``MAX_OPEN`` per connection and
``max_registered`` bytes, unregistered when the request ends or its connection closes (a client
killed with SIGKILL included: its TCP connection ends, ``RdmaSession.close`` frees all).

In the engine's TCP mode unregistering does not end a peer's request already under way, so the
engine is told only about memory of its own (``rdma_memory.EngineMemory``): a put lands there and
is copied into the store's reservation after RDMA_END unregisters it, its checksums checked on
the copy; a get's copy is such memory. Stored bytes and reservations are then never within reach.
That memory counts in the store's capacity (``rdma.engine``) from the moment it is taken.

It is an ``Extension`` (request.py) the first rdma:// listener adds to its server; its handlers
refuse requests that did not come in on an rdma:// listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tensorwire import transport
from tensorwire.errors import CorruptFrame, InvalidTensor, LimitExceeded, ProtocolError
from tensorwire.server.metrics import RequestCounts
from tensorwire.server.options import ServerOptions
from tensorwire.server.rdma_memory import EngineMemory, size_class
from tensorwire.server.request import Extension, Handler, Request, extension_of, listener_only
from tensorwire.store import Reservation, TensorStore
from tensorwire.store.pool import BufferPool, allocate_private
from tensorwire.transport import tls
from tensorwire.transport.base import ByteStream, Listener
from tensorwire.transport.rdma_engine import (
    DEFAULT_MAX_PEERS,
    HOST_ENV,
    SILENT_GRACE,
    Engine,
    address_of,
    prefault,
)
from tensorwire.types import Address, GiB, KiB, MiB, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import rdma as wr
from tensorwire.wire.frame import Opcode

MAX_OPEN = 64  # per connection: puts reserved and gets leased, not yet ended
DEFAULT_MAX_REGISTERED = 16 * GiB  # per connection: bytes registered with the engine at once
INLINE_MAX = 64 * KiB  # smaller tensors travel in the frames (an engine transfer costs ~50 us)
_ids = itertools.count(1)


class RdmaHost(Protocol):
    """What serving rdma:// needs of the server (``core.Server`` is one)."""

    @property
    def store(self) -> TensorStore: ...

    @property
    def options(self) -> ServerOptions: ...  # max_connections also bounds the engine's ports

    @property
    def counts(self) -> RequestCounts: ...

    @property
    def extensions(self) -> Sequence[Extension]: ...

    async def handle(self, stream: ByteStream, transport: str = "tcp") -> None: ...

    def extend(self, extension: Extension) -> None: ...


@dataclass(eq=False)
class Open:
    """One request's registered buffers: a put's reservation, or a get's copies."""

    regions: list[int]  # addresses registered with the engine
    nbytes: int
    refs: list[wr.BufferRef]
    reservation: Reservation | None = None  # a put
    copies: list[memoryview] = field(default_factory=list)  # a get
    release_hold: Callable[[], None] | None = None  # RDMA mode: a get's copies, counted in the store's used
    landings: list[memoryview] = field(default_factory=list)  # TCP mode: where a put's bytes land, by ref


class RdmaSession:
    """One control connection's open requests (its ``close`` runs when the connection ends)."""

    def __init__(self) -> None:
        self.service: RdmaService | None = None
        self.open: dict[int, Open] = {}
        self.registered = 0

    def end(self, reservation: int) -> Open | None:
        """Unregister and forget one open request (its buffers' bytes are the caller's now)."""
        entry = self.open.pop(reservation, None)
        if entry is not None and self.service is not None:
            self.registered -= entry.nbytes
            self.service.unregister(entry)
        return entry

    def close(self) -> None:
        service = self.service
        for reservation in list(self.open):
            entry = self.end(reservation)
            if entry is not None and service is not None:
                service.free(entry)


class RdmaService:
    """The engine and the RDMA_* handlers of one server: an ``Extension`` (module docstring)."""

    def __init__(
        self,
        store: TensorStore,
        host: str,
        *,
        max_registered: int = DEFAULT_MAX_REGISTERED,
        inline_max: int = INLINE_MAX,
        max_engine_memory: int = DEFAULT_MAX_REGISTERED,
        max_peers: int = DEFAULT_MAX_PEERS,
        silent_grace: float = SILENT_GRACE,
        on_cut: Callable[[str, int], None] | None = None,
    ) -> None:
        self.store = store
        # RdmaUnavailable here: the listener does not start. Its ports take at most ``max_peers``
        # connections (the server's --max-connections; ``on_cut`` counts those shut down).
        self.engine = Engine(host, max_peers=max_peers, silent_grace=silent_grace, on_cut=on_cut)
        # TCP mode: the only memory the engine is told about (rdma_memory.py), at most this much.
        self.memory = (
            EngineMemory(self.engine, store, max_engine_memory) if self.engine.protocol == "tcp" else None
        )
        self.max_registered = max_registered
        self.inline_max = inline_max
        # A get's copies: reused, so a warm get faults no page (a fresh one costs more than the copy).
        self.copies = BufferPool(limit=store.pool_limit, min_size=MiB)
        self.open = 0  # requests holding registered buffers, all connections (STATUS)

    def frame_handlers(self) -> dict[int, Handler]:
        table: dict[int, Handler] = {
            Opcode.RDMA_ATTACH: self.attach,
            Opcode.RDMA_PUT: self.put,
            Opcode.RDMA_GET: self.get,
            Opcode.RDMA_END: self.end,
        }
        return listener_only("rdma", table)  # only rdma:// connections may have memory registered

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    def collectors(self) -> list[Any]:
        return []

    def status(self) -> dict[str, Any]:
        """STATUS's ``rdma`` part: what the engine exposes now (the fault tests poll it)."""
        engine, memory = self.engine, self.memory
        registered = sum(engine.registered.values())
        doc = {"session": engine.session, "protocol": engine.protocol, "open": self.open,
               "registered_buffers": len(engine.registered), "registered_bytes": registered,
               "ports": engine.sockets.describe()}  # fmt: skip
        if engine.guard is not None:  # connections to the engine's ports shut down, by reason
            doc["peers"] = {"bound": engine.max_peers, "shut": dict(engine.guard.shut)}
        if memory is not None:
            doc["engine_memory"] = {"held": memory.held, "idle": memory.idle, "reclaims": memory.reclaims}
        return {"rdma": doc}

    async def close(self) -> None:
        self.engine.close()  # its connections close with it: no peer request touches its memory after
        if self.memory is not None:
            await self.memory.close()

    def session(self, req: Request) -> RdmaSession:
        session = req.session_state(RdmaSession)
        if session.service is None:
            raise ProtocolError("RDMA_ATTACH must come before the other RDMA_* requests")
        return session

    # -- registration ------------------------------------------------------------------------------
    def _register(self, session: RdmaSession, buffers: Sequence[memoryview]) -> list[int]:
        """Register ``buffers`` for one request of ``session``, within its bounds."""
        nbytes = sum(b.nbytes for b in buffers)
        if len(session.open) >= MAX_OPEN:
            raise LimitExceeded(f"{MAX_OPEN} RDMA requests are open on this connection already")
        if session.registered + nbytes > self.max_registered:
            raise LimitExceeded(
                f"this connection has {session.registered} bytes registered; {nbytes} more would pass "
                f"{self.max_registered}"
            )
        regions: list[int] = []
        try:
            for buf in buffers:
                regions.append(address_of(buf))
                self.engine.register(regions[-1], buf.nbytes)
        except BaseException:
            for address in regions:
                self.engine.unregister(address)
            raise
        return regions

    def _keep(self, session: RdmaSession, entry: Open) -> int:
        reservation = next(_ids)
        session.open[reservation] = entry
        session.registered += entry.nbytes
        self.open += 1
        return reservation

    def unregister(self, entry: Open) -> None:
        for address in entry.regions:
            self.engine.unregister(address)
        entry.regions = []
        self.open -= 1

    def free(self, entry: Open) -> None:
        """What an ended request held goes back: a put's reservation, a get's copies (to the
        engine's memory in TCP mode, which keeps them from anything else)."""
        if entry.reservation is not None:
            self.store.abort(entry.reservation)  # a no-op once committed
        if entry.release_hold is not None:  # first: what is handed back may count from now
            entry.release_hold()
        for buf in [*entry.copies, *entry.landings]:
            if self.memory is not None:
                self.memory.give(buf)
            else:
                self.copies.give(buf)
        entry.copies, entry.landings = [], []

    # -- handlers ----------------------------------------------------------------------------------
    async def attach(self, req: Request) -> None:
        protocol = wr.decode_attach_request(req.meta)
        if protocol != self.engine.protocol:
            raise ProtocolError(
                f"this server's engine moves bytes over {self.engine.protocol}, not {protocol}: "
                "set TENSORWIRE_RDMA_PROTOCOL the same on both sides"
            )
        session = req.session_state(RdmaSession)
        session.service = self
        answer = wr.Attach(self.engine.session, self.engine.protocol, self.inline_max, self.engine.instance)
        await req.reply(wr.encode_attach_answer(answer))

    def _large(self, meta: TensorMeta) -> bool:
        return meta.nbytes > self.inline_max

    async def put(self, req: Request) -> None:
        session = self.session(req)
        metas = wm.decode_records(req.meta)
        req.meta.done()
        if not metas:
            raise ProtocolError("RDMA_PUT carries no tensors")
        res = self.store.reserve(metas)
        landings: list[memoryview] = []
        try:
            large = [i for i, meta in enumerate(res.metas) if self._large(meta)]
            targets = [res.buffers[i] for i in large]
            if self.memory is not None:  # TCP mode: land apart, copied into the reservation at commit
                admitted = res.charge  # the landings may use the room the reservation counts
                for target in targets:
                    landings.append(await self.memory.take(target.nbytes, admitted))
                    admitted = max(admitted - size_class(target.nbytes), 0)
                targets = landings
            else:
                await asyncio.get_running_loop().run_in_executor(None, _prefault, targets)
            regions = self._register(session, targets)
        except BaseException:
            self.store.abort(res)
            self._give_back(landings)
            raise
        refs = [wr.BufferRef(i, res.metas[i], address) for i, address in zip(large, regions, strict=True)]
        entry = Open(regions, sum(t.nbytes for t in targets), refs, reservation=res, landings=landings)
        reservation = self._keep(session, entry)
        await req.reply(wr.encode_u64(reservation) + wr.encode_refs(refs, with_checksums=False))

    async def get(self, req: Request) -> None:
        session = self.session(req)
        chunk, names = wr.decode_get_request(req.meta)
        self._check_chunk(req, chunk)
        if not names or len(set(names)) != len(names):
            raise ProtocolError("RDMA_GET names no tensor, or one tensor twice")
        entries = self.store.acquire(names)
        try:  # pinned until the answer is out: the inline tensors' bytes go out from them
            large = [i for i, e in enumerate(entries) if self._large(e.meta)]
            entry = await self._copies(
                session, req, [(i, entries[i].meta, entries[i].data) for i in large], chunk
            )
            reservation = self._keep(session, entry) if entry.refs else 0
            if not entry.refs:
                self.free(entry)
            inline = [e for i, e in enumerate(entries) if i not in set(large)]
            meta = wm.encode_records([e.meta for e in inline]) + wr.encode_u64(reservation)
            await req.reply(
                meta + wr.encode_refs(entry.refs, with_checksums=True), [e.payload for e in inline]
            )
        finally:
            self.store.release(entries)

    async def _copies(
        self,
        session: RdmaSession,
        req: Request,
        large: Sequence[tuple[int, TensorMeta, memoryview]],
        chunk: int,
    ) -> Open:
        """Private copies of the large tensors of a get (counted in the store's ``used``: held for
        the request, or in TCP mode charged as the engine's memory they are taken from), their
        chunk checksums, registered for this request."""
        release = self.store.hold(sum(meta.nbytes for _, meta, _ in large)) if self.memory is None else None
        copies: list[memoryview] = []
        try:
            copies = await self._take_copies([data for _, _, data in large])
            sums = await self._checksummed_copies(
                [data for _, _, data in large], copies, req.header.checksum, chunk
            )
            regions = self._register(session, copies)
        except BaseException:
            if release is not None:
                release()
            self._give_back(copies)
            raise
        refs = [
            wr.BufferRef(i, meta, address, s)
            for (i, meta, _), address, s in zip(large, regions, sums, strict=True)
        ]
        return Open(regions, sum(c.nbytes for c in copies), refs, copies=copies, release_hold=release)

    def _check_chunk(self, req: Request, chunk: int) -> None:
        limits = req.connection.limits
        if not limits.min_chunk_bytes <= chunk <= limits.max_chunk_bytes:
            raise LimitExceeded(
                f"chunk size {chunk} outside {limits.min_chunk_bytes}..{limits.max_chunk_bytes}"
            )

    async def _take_copies(self, sources: Sequence[memoryview]) -> list[memoryview]:
        """A buffer for each source's copy: the engine's memory in TCP mode, else the copies pool."""
        if self.memory is None:
            return [self.copies.take(s.nbytes) or allocate_private(s.nbytes) for s in sources]
        copies: list[memoryview] = []
        try:
            for src in sources:
                copies.append(await self.memory.take(src.nbytes))
        except BaseException:
            self._give_back(copies)
            raise
        return copies

    async def _checksummed_copies(
        self, sources: Sequence[memoryview], copies: Sequence[memoryview], kind: int, chunk: int
    ) -> list[tuple[int, ...]]:
        """Copy ``sources`` into ``copies`` and checksum the copies' chunks (off the loop: a copy of
        a large tensor takes milliseconds)."""

        def work() -> list[tuple[int, ...]]:
            sums = []
            for src, dest in zip(sources, copies, strict=True):
                dest[:] = src
                sums.append(wr.chunk_checksums(kind, dest, chunk))
            return sums

        return await asyncio.get_running_loop().run_in_executor(None, work)

    def _give_back(self, buffers: Sequence[memoryview]) -> None:
        for buf in buffers:
            if self.memory is not None:
                self.memory.give(buf)

    async def end(self, req: Request) -> None:
        session = self.session(req)
        reservation, action, commit = wr.decode_end(req.meta)
        if reservation not in session.open:
            raise ProtocolError(f"RDMA_END of reservation {reservation}, which this connection does not hold")
        entry = session.end(reservation)  # unregistered: from here on no engine peer can change its bytes
        assert entry is not None
        if action is wr.End.RELEASE or commit is None:
            self.free(entry)  # before the answer: a client told "released" finds it so
            await req.reply(b"")
            return
        try:
            if entry.reservation is None:
                raise ProtocolError(f"RDMA_END commits reservation {reservation}, which is a get's")
            version = await self._commit(req, entry, entry.reservation, commit)
        finally:
            self.free(entry)
        await req.reply(wr.encode_u64(version))

    async def _commit(self, req: Request, entry: Open, res: Reservation, commit: wr.Commit) -> int:
        """Check every chunk the engine wrote against the client's checksums, receive the inline
        tensors (checked per chunk too), then store them all at once."""
        self._check_chunk(req, commit.chunk)
        if len(commit.checksums) != len(entry.refs):
            raise ProtocolError("RDMA_END's checksums do not match the put's buffers one for one")
        large = {ref.item for ref in entry.refs}
        inline = [
            (m, b) for i, (m, b) in enumerate(zip(res.metas, res.buffers, strict=True)) if i not in large
        ]
        if [m for m, _ in inline] != commit.inline:
            raise ProtocolError("RDMA_END's inline records are not those of the put it commits")
        buffers = [b for _, b in inline]
        if sum(b.nbytes for b in buffers) != req.header.data_len:
            raise InvalidTensor("the inline records' sizes do not add up to the frame's data length")
        await req.receive(buffers)
        kind = req.header.checksum
        written = [(ref, res.buffers[ref.item]) for ref in entry.refs]
        landed = entry.landings  # TCP mode: the bytes are checked once copied where they are stored

        def verify() -> str | None:
            for (_, stored), source in zip(written, landed, strict=False):
                stored[:] = source
            for (ref, buf), sums in zip(written, commit.checksums, strict=True):
                bad = wr.bad_chunk(kind, buf, commit.chunk, sums)
                if bad is not None:
                    return f"chunk {bad} of {ref.meta.name!r} is not what the client wrote"
            return None

        failure = await asyncio.get_running_loop().run_in_executor(None, verify)
        if failure is not None:
            raise CorruptFrame(f"{failure}: a corrupt or short transfer; nothing stored")
        return await self.store.call(self.store.commit, res)


def _prefault(buffers: Sequence[memoryview]) -> None:
    for buf in buffers:
        prefault(buf)


def _counter(server: RdmaHost) -> Callable[[str, int], None]:
    """What counts the connections to the engine's ports its guard shut down, from the guard's
    thread: ``tensorwire_connections_refused_total`` reasons ``rdma_limit`` (beyond
    --max-connections) and ``rdma_silent`` (nothing sent in time), on the server's loop."""
    loop, counts = asyncio.get_running_loop(), server.counts

    def bump(reason: str, count: int) -> None:
        for _ in range(count):
            counts.refuse(f"rdma_{reason}")

    def count(reason: str, count: int) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to count for
            loop.call_soon_threadsafe(bump, reason, count)

    return count


def engine_host(address: Address) -> str:
    """The address peers reach this server's engine at: the listener's own, or for a wildcard
    bind ``TENSORWIRE_RDMA_HOST`` (else this host's name)."""
    if address.host in ("0.0.0.0", "::", ""):
        return os.environ.get(HOST_ENV) or socket.gethostname()
    return address.host


async def listen(server: RdmaHost, address: Address, context: ssl.SSLContext | None = None) -> Listener:
    """Serve ``rdma://HOST:PORT`` (or ``rdmas://``, with ``context``: the control connection inside
    TLS): control at HOST:PORT, bytes through this process's engine."""
    service = extension_of(server.extensions, RdmaService)  # one per server, made by its first rdma://
    first = service is None
    if service is None:
        service = RdmaService(
            server.store,
            engine_host(address),
            max_peers=server.options.connections.max_connections,
            silent_grace=min(SILENT_GRACE, server.options.connections.auth_timeout),
            on_cut=_counter(server),
        )
    try:
        handler = functools.partial(server.handle, transport="rdma")  # both kinds: the RDMA_* opcodes
        if context is not None:
            listener: Listener = await tls.listen(address, handler, context)
        else:
            listener = await transport.listen(address, handler)
    except BaseException:
        if first:
            await service.close()
        raise
    if first:
        server.extend(service)
    return listener


__all__ = ["RdmaService", "RdmaSession", "listen"]
