"""One connection of the frame protocol: its frame loop, its authentication, and the deadlines the
server's watchdog holds it to.

The loop reads a frame, runs it and answers, in order. A request the server refuses for what its
metadata or data says (bad name, unknown dtype, too many dims or items, capacity full, a missing
key, a corrupt data chunk) gets an ERROR frame and the session goes on. A frame whose header
cannot be trusted (bad magic, unsupported version, header checksum mismatch, a metadata or data
length over the limit, an unknown checksum kind) gets an ERROR frame and ends the session, since
the stream can no longer be cut into frames safely.

Every opcode is looked up in one table (``Serving.handlers``: the store's operations and the
extensions'); one that nothing serves here gets PROTOCOL_ERROR naming what would serve it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from dataclasses import dataclass
from typing import Any

from tensorwire._aio import hold_now
from tensorwire.errors import (
    AuthenticationError,
    ConnectionLost,
    CorruptFrame,
    ProtocolError,
    TensorwireError,
    code_for_error,
)
from tensorwire.logs import event
from tensorwire.security import tokens_match
from tensorwire.server.metrics import RequestCounts, op_name
from tensorwire.server.request import Handler, ReadyHandler, Request, Spanning, is_peer_token, opname
from tensorwire.store import TensorStore
from tensorwire.transport.base import ByteStream
from tensorwire.transport.frame_io import FrameReader, read_head
from tensorwire.transport.plain import ReadyIO
from tensorwire.transport.whole import frame_size
from tensorwire.types import Limits
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import (
    HEADER_BYTES,
    OPCODES,
    PROTOCOL_VERSIONS,
    Flags,
    Header,
    Opcode,
    check_meta_crc,
    decode_header,
    encode_frame_head,
)

log = logging.getLogger("tensorwire.server")
_RID = struct.Struct("<Q")
_MORE = int(Flags.MORE)  # a plain int: ``int & IntFlag`` runs IntFlag's Python __rand__ on every request
# Two version bytes, a u16 length, the token, the compression field (2), wants (1).
_HELLO_MAX_META = 7 + wm.MAX_TOKEN_BYTES

# Opcodes only an extension serves: what a server without it answers (PROTOCOL_ERROR).
_NO_PS = "this server does not serve {} (`tensorwire ps serve` does)"
_NO_SHM = "this server serves no shared memory (no shm:// listener): {}"
_PS_OPS = (
    Opcode.PS_INIT, Opcode.PS_JOIN, Opcode.PS_LEAVE, Opcode.PS_PUSH, Opcode.PS_PULL, Opcode.PS_STATS,
    Opcode.ALLREDUCE, Opcode.PS_HEARTBEAT, Opcode.PS_ROLLBACK, Opcode.PS_REPLICATE, Opcode.DIGEST,
    Opcode.PS_BARRIER, Opcode.PS_END, Opcode.PS_RELAY,
)  # fmt: skip
_SHM_OPS = (
    Opcode.SHM_ATTACH, Opcode.SHM_GET, Opcode.SHM_PUT, Opcode.SHM_COMMIT, Opcode.SHM_RELEASE,
    Opcode.SHM_GEN_VIEW, Opcode.SHM_GEN_PART,
)  # fmt: skip
_NO_RDMA = "this server serves no RDMA (no rdma:// listener): {}"
_RDMA_OPS = (Opcode.RDMA_ATTACH, Opcode.RDMA_PUT, Opcode.RDMA_GET, Opcode.RDMA_END)
SERVED_BY: dict[int, str] = {
    **dict.fromkeys(_PS_OPS, _NO_PS),
    **dict.fromkeys(_SHM_OPS, _NO_SHM),
    **dict.fromkeys(_RDMA_OPS, _NO_RDMA),
}
# opcodes whose parts may span frames
SPANNING = frozenset((Opcode.PUT_MANY, Opcode.GEN_PUBLISH, Opcode.GEN_PUBLISH_PART))
# requests served by one readiness callback at most, before the loop's other connections have a turn
_READY_FRAMES = 64


@dataclass(frozen=True, slots=True, eq=False)
class Serving:
    """What every session of one server shares (``Server`` builds it once)."""

    store: TensorStore
    limits: Limits
    handlers: dict[int, Handler]  # the server's one table; an extension added later joins it in place
    ready: dict[Handler, ReadyHandler]  # the form of some handlers for a readiness callback
    counts: RequestCounts
    token: str | None  # what a client's HELLO must offer, when set
    peer_token: str | None  # what a replica's HELLO offers instead (``Replicated``)


class Session:
    """One connection (it is the ``request.Connection`` its requests see).

    ``run`` serves frames until the peer leaves or its bytes stop making frames; ``close`` then
    drops what the connection held (an open multi-frame PUT_MANY, extensions' states). The watchdog
    reads ``opened``/``admitted`` (the auth deadline), ``busy`` and ``stream.last_active`` (stall
    and idle timeouts)."""

    def __init__(self, serving: Serving, stream: ByteStream, transport: str) -> None:
        self.serving = serving
        self.stream = stream
        self.transport = transport
        self.store = serving.store
        self.limits = serving.limits
        self.counts = serving.counts
        self.reader = FrameReader(stream)
        self.version = PROTOCOL_VERSIONS[-1]
        self.encoder: lossless.Encoder | None = None  # how answers are compressed (HELLO; §5.5)
        self.spanning: Spanning | None = None  # a PUT_MANY arriving in several frames
        self.states: dict[type, Any] = {}  # extensions' per-connection state (Request.session_state)
        self.failed = False  # whether the current request was answered with an error (metrics)
        self.in_request = False
        self.authenticated = serving.token is None
        # Until its first frame is in (and authenticated, where a token is required), a connection
        # has until ``opened + auth_timeout``: with a token or without, a peer that says nothing
        # (a stalled TLS handshake, a silent socket) does not keep its slot for the idle timeout.
        self.opened = time.monotonic()
        self.admitted = False
        self.from_peer = False  # a replica of this server's slot (its HELLO offered the peer token)
        self.working = False  # the server, not the peer, is what a request waits on (a disk write)
        # Keeps frames whole: an answer sent later (a parked GEN_WAIT) goes out between the others.
        self.write_lock = asyncio.Lock()
        self.unsent: memoryview | None = None  # the rest of an answer ``_ready`` could not send, till sent

    @property
    def busy(self) -> bool:
        """In the middle of a request (or of a multi-frame batch): a stall here is not idleness."""
        return (self.in_request or self.spanning is not None) and not self.working

    async def run(self) -> None:
        while await self._next_frame():
            self.in_request = True
            raw = await read_head(self.reader)
            try:
                header = decode_header(raw, self.limits)
                if not self.authenticated and (header.meta_len > _HELLO_MAX_META or header.data_len):
                    # Before the token is checked, nothing larger than a HELLO is read at all.
                    await self._authenticate(header, b"")
                    return
                meta = await self.reader.read(header.meta_len)
                check_meta_crc(raw, header, meta)
                if header.is_response:
                    raise ProtocolError("a client sent a response frame")
            except ProtocolError as exc:
                # The header cannot be trusted, so neither can the frame boundaries: answer, then hang up.
                await self.send_error(_request_id(raw), exc)
                return
            if not self.authenticated and not await self._authenticate(header, meta):
                return
            self.admitted = True
            await self._serve(Request(self, header, wm.MetaReader(meta, self.limits)))
            self.in_request = False

    async def _next_frame(self) -> bool:
        """Wait for the next frame; False if the peer closed the stream between frames. Past its
        first frame, a session waits with ``serve_idle``: the small requests that come whole are
        served from the loop's readiness callback (``_ready``), and only the rest wakes this task."""
        if self.admitted and self.spanning is None and not self.reader.buffered:
            await self.stream.serve_idle(self._ready)
            if self.unsent is not None:
                await self._flush(self.unsent)
        return await self.reader.at_frame_start()

    def _ready(self, io: ReadyIO) -> bool:
        """The readiness callback while the task waits for a frame: serve what one receive brought,
        as long as it comes as whole requests with a ``ReadyHandler``, at most ``_READY_FRAMES`` of
        them (the loop's other connections wait meanwhile). True: all of it was served."""
        reader = self.reader
        try:
            got = reader.pull(io)
            if not got:
                return got is None  # None: woken for nothing, wait on; 0: the peer closed (the task sees it)
            for _ in range(_READY_FRAMES):
                if reader.buffered < HEADER_BYTES or not self._serve_ready(io):
                    break
        except ConnectionLost:
            return False  # the task meets it again, and ends the session
        except Exception:  # never into the loop's callback: the task serves the frame instead
            log.exception("serving %s from its readiness callback failed", self.stream.peer)
            return False
        return not reader.buffered and self.unsent is None

    def _serve_ready(self, io: ReadyIO) -> bool:
        """Serve the next buffered frame here if it is a whole request (with at most one chunk of
        data) that a ``ReadyHandler`` answers now; False (nothing taken) to leave it to the task,
        which also answers every frame whose header or metadata fails its checks."""
        reader = self.reader
        raw = reader.peek(HEADER_BYTES)
        try:
            header = decode_header(raw, self.limits)
        except ProtocolError:
            return False
        size = frame_size(header)
        handler = self.serving.handlers.get(header.opcode)  # the one table: a removed opcode is gone here too
        now = self.serving.ready.get(handler) if handler is not None else None
        if now is None or header.flags or header.data_len > header.chunk_size or reader.buffered < size:
            return False  # flags: MORE and COMPRESSED are the task's; more than a chunk of data too
        frame = reader.peek(size)
        meta_end = HEADER_BYTES + header.meta_len
        meta = bytes(frame[HEADER_BYTES:meta_end])
        try:
            check_meta_crc(raw, header, meta)
        except ProtocolError:
            return False
        if not hold_now(self.write_lock):
            return False  # an answer sent later (GEN_WAIT) is going out: the task waits its turn
        try:
            request = Request(self, header, wm.MetaReader(meta, self.limits), frame[meta_end:])
            return self._run_ready(io, now, request, size)
        finally:
            if self.unsent is None:
                self.write_lock.release()

    def _run_ready(self, io: ReadyIO, now: ReadyHandler, request: Request, size: int) -> bool:
        header = request.header
        started = time.perf_counter()
        self.failed = False
        try:
            frame = now(request)
        except Exception as exc:
            if not isinstance(exc, TensorwireError):
                log.exception("request %d (%s) failed", header.request_id, opname(header.opcode))
            frame = self._error_frame(header.request_id, exc, header.opcode)
        if frame is None:
            return False
        self.reader.take(size)
        row = self.counts.begin(op_name(header.opcode), self.transport, header.data_len)
        try:
            sent = io.try_send(frame)
        finally:
            self.counts.end(row, request.sent, self.failed, time.perf_counter() - started)
        if sent < len(frame):
            self.unsent = memoryview(frame)[sent:]  # the task sends the rest, holding the write lock
            return False
        return True

    async def _flush(self, unsent: memoryview) -> None:
        """Send the rest of an answer the readiness callback could not send whole (the peer reads
        slowly), under the write lock it took; a peer that stops reading meets the stall timeout."""
        self.in_request = True
        try:
            await self.stream.send([unsent])
        finally:
            self.unsent = None
            self.write_lock.release()
            self.in_request = False

    async def _serve(self, request: Request) -> None:
        """Run one request, counted in the metrics; whatever happens, its data section is consumed
        (``Request.finish``) unless the stream is gone."""
        header = request.header
        started = time.perf_counter()
        row = self.counts.begin(op_name(header.opcode), self.transport, header.data_len)
        self.failed = False
        try:
            await self._dispatch(request)
        except ConnectionLost:
            raise
        except Exception as exc:
            if not isinstance(exc, TensorwireError):
                log.exception("request %d (%s) failed", header.request_id, opname(header.opcode))
            await request.finish()
            await self.send_error(header.request_id, exc, header.opcode)
        else:
            await request.finish()  # a handler that answered without the data: keep the stream in step
        finally:
            self.counts.end(row, request.sent, self.failed, time.perf_counter() - started)

    async def _dispatch(self, request: Request) -> None:
        header = request.header
        op = header.opcode
        spanning = self.spanning
        if spanning is not None and (op not in SPANNING or header.request_id != spanning.request_id):
            await self._interrupted(request)  # whatever the frame is, it broke the open batch
        if op not in OPCODES:
            raise ProtocolError(f"unknown opcode {op}")
        if header.flags & _MORE and op not in SPANNING:
            only = "only PUT_MANY, GEN_PUBLISH and GEN_PUBLISH_PART can span several frames"
            raise ProtocolError(f"{only}, not {opname(op)}")
        handler = self.serving.handlers.get(op)
        if handler is None:
            raise ProtocolError(SERVED_BY.get(op, "this server does not serve {}").format(opname(op)))
        await handler(request)

    async def _interrupted(self, request: Request) -> None:
        """Another frame arrived in the middle of a multi-frame PUT_MANY: the client broke its own
        batch, so nothing of it can be trusted. Answer, then hang up."""
        self.abort_spanning()
        await request.skip()
        error = ProtocolError("a request interrupted a multi-frame PUT_MANY")
        await self.send_error(request.header.request_id, error, request.header.opcode)
        raise ConnectionLost("a client interrupted its own multi-frame PUT_MANY")

    def abort_spanning(self) -> None:
        """Drop a multi-frame batch the connection died (or was broken) in the middle of."""
        if self.spanning is not None:
            self.spanning.abort()
            self.spanning = None

    def close(self) -> None:
        """The connection ended: drop what it held. Each extension's state is closed on its own: one
        that fails (logged) must not keep the others' holdings (open puts, leases) for ever."""
        self.abort_spanning()
        for state in self.states.values():
            close = getattr(state, "close", None)
            if close is None:
                continue
            try:
                close()
            except Exception:
                log.exception("closing %s of %s failed", type(state).__name__, self.stream.peer)

    async def _authenticate(self, header: Header, meta: bytes) -> bool:
        """The first frame of a connection to a server with a token must be a HELLO that carries
        it (or the peer token: a replica of its slot). Anything else gets one UNAUTHENTICATED error
        and the connection is closed, before any store operation runs."""
        offered = None
        if header.opcode == Opcode.HELLO:
            with contextlib.suppress(TensorwireError):
                offered = wm.decode_hello_request(wm.MetaReader(meta, self.limits))[2]
        token = self.serving.token
        if token is not None and (
            tokens_match(token, offered) or is_peer_token(self.serving.peer_token, offered)
        ):
            self.authenticated = True
            return True
        why = "no token was offered" if offered is None else "the token is wrong"
        self.counts.refuse("auth")
        event(log, logging.WARNING, "connection refused", peer=self.stream.peer, reason=why)
        error = AuthenticationError(f"authentication failed: {why}")
        await self.send_error(header.request_id, error, header.opcode)
        return False

    async def send_error(self, request_id: int, exc: BaseException, opcode: int = 0) -> None:
        frame = self._error_frame(request_id, exc, opcode)
        with contextlib.suppress(ConnectionLost):
            async with self.write_lock:
                await self.stream.send([frame])

    def _error_frame(self, request_id: int, exc: BaseException, opcode: int) -> bytes:
        """The ERROR frame answering request ``request_id`` with ``exc``; counted as failed."""
        self.failed = True
        if isinstance(exc, CorruptFrame):
            self.counts.checksum_failed(self.transport)
            event(log, logging.WARNING, "checksum failure", peer=self.stream.peer, op=opname(opcode),
                  transport=self.transport, error=str(exc))  # fmt: skip
        message = str(exc) if isinstance(exc, TensorwireError) else f"internal error: {type(exc).__name__}"
        meta = wm.encode_error(code_for_error(exc), message)
        return encode_frame_head(
            Header(self.version, opcode, Flags.RESPONSE | Flags.ERROR, 0, request_id, len(meta), 0, 0), meta
        )


def _request_id(raw: bytes) -> int:
    """The request id of a frame whose header failed its checks, so the client can match the error
    to its request (the server then closes the connection, which fails the client's others)."""
    return int(_RID.unpack_from(raw, 8)[0])
