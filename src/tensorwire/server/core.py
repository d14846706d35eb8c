"""The tensorwire server: a TensorStore served over every listening address.

Each connection is one session that reads a frame, runs it and answers, in order. A request the
server refuses for what its metadata or data says (bad name, unknown dtype, too many dims or items,
capacity full, a missing key, a corrupt data chunk) gets an ERROR frame and the session goes on. A
frame whose header cannot be trusted (bad magic, unsupported version, header checksum mismatch, a
metadata or data length over the limit, an unknown checksum kind) gets an ERROR frame and ends the
session, since the stream can no longer be cut into frames safely. A put becomes visible only
after every chunk was verified (``TensorStore``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from tensorwire import transport
from tensorwire._gc import gc_paused
from tensorwire.errors import (
    AuthenticationError,
    ConnectionLost,
    CorruptFrame,
    InvalidTensor,
    LimitExceeded,
    ProtocolError,
    TensorwireError,
    UnsupportedVersion,
    VersionChanged,
    code_for_error,
)
from tensorwire.logs import event
from tensorwire.security import (
    MAX_TOKEN_BYTES,
    Security,
    TlsFiles,
    exposure_warning,
    server_ssl_context,
    tokens_match,
)
from tensorwire.server import metrics
from tensorwire.store import Entry, Reservation, TensorStore
from tensorwire.store.uploads import (
    DEFAULT_MAX_UPLOADS,
    DEFAULT_RESUMABLE_MIN_BYTES,
    DEFAULT_UPLOADS_PER_CLIENT,
    Upload,
    UploadBusy,
    Uploads,
    client_of,
)
from tensorwire.transport import tls
from tensorwire.transport.base import ByteStream, Listener
from tensorwire.transport.frame_io import (
    FrameReader,
    compressed_scratch,
    read_head,
    recv_data,
    send_frame,
    skip_data,
)
from tensorwire.types import Address, Limits, TensorMeta
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import (
    CHECKSUM_KINDS,
    DEFAULT_CHUNK_BYTES,
    OPCODES,
    PROTOCOL_VERSIONS,
    Flags,
    Header,
    Opcode,
    check_meta_crc,
    decode_header,
)

log = logging.getLogger("tensorwire.server")
S = TypeVar("S")
_RID = struct.Struct("<Q")
# A request that names thousands of tensors costs tens to hundreds of milliseconds of Python work
# (decoding records, checking names, installing or pinning entries, encoding the answer's records):
# from this many metadata bytes or tensors on, that work runs on a worker thread, so the loop
# keeps serving the others meanwhile.
_OFF_LOOP_META = 64 << 10
_OFF_LOOP_TENSORS = 2048
_BUSY_WAIT = 10.0  # most seconds a write waits for another connection to let go of its upload's bytes
# Two version bytes, a u16 length, the token, the compression field (2), wants (1).
_HELLO_MAX_META = 7 + MAX_TOKEN_BYTES


class Request:
    """One request for an opcode that an extension serves (see ``Extension``).

    The handler reads its metadata from ``meta``, then either ``receive``s the data section into
    buffers of its own (every chunk verified before it returns) or ``skip``s it, and answers once
    with ``reply``. Raising a ``TensorwireError`` answers with an ERROR frame, as for any request.
    """

    __slots__ = ("_session", "header", "meta")

    def __init__(self, session: _Session, header: Header, meta: wm.MetaReader) -> None:
        self._session = session
        self.header = header
        self.meta = meta

    @property
    def peer(self) -> str:
        return self._session.stream.peer

    @property
    def transport(self) -> str:
        """The kind of listener the request came in on ("tcp", "tls", "shm", "memory"): an opcode
        that belongs to one transport checks it before anything else."""
        return self._session.transport

    @property
    def from_peer(self) -> bool:
        """Whether the connection is a peer session: its HELLO offered the server's peer token (a
        replica of the same slot), so it may send replication requests."""
        return self._session.peer

    def session_state(self, key: type[S]) -> S:
        """This connection's instance of ``key`` (made with ``key()`` on first use): an extension's
        per-connection state. Its ``close()``, if it has one, runs when the connection ends."""
        state = self._session.states.get(key)
        if state is None:
            state = self._session.states[key] = key()
        return state

    async def receive(self, buffers: Sequence[memoryview]) -> None:
        """Read the data section into ``buffers`` (their sizes must add up to its length)."""
        await self._session.receive(self.header, buffers)

    async def skip(self) -> None:
        if not self._session.data_read:
            self._session.data_read = True
            await skip_data(self._session.reader, self.header)

    async def reply(self, meta: bytes, data: Sequence[memoryview] = ()) -> None:
        await self._session.reply(self.header, meta, data)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """While inside, the request waits on the server (other workers, a step), not on its peer:
        the stall watchdog leaves the connection alone."""
        self._session.working = True
        try:
            yield
        finally:
            self._session.working = False
            self._session.stream.last_active = time.monotonic()


Handler = Callable[[Request], Awaitable[None]]


class Extension(Protocol):
    """More operations on the same listeners: the parameter server is one (``tensorwire.ps``).

    One that also has ``collectors()`` and ``status()`` (``metrics.Observed``) adds Prometheus
    families to the server's registry and a part to its STATUS answer."""

    def frame_handlers(self) -> Mapping[int, Handler]:
        """Opcode -> handler, for the frame protocol (tcp://, tls://, memory://)."""
        ...

    def rpc_handlers(self) -> Sequence[Any]:
        """``grpc.GenericRpcHandler`` objects served next to TensorService on grpc:// addresses."""
        ...

    async def close(self) -> None:
        """The server stops: finish (a parameter server writes its last checkpoint)."""
        ...


@runtime_checkable
class Replicated(Protocol):
    """An extension whose replicas talk to each other (the parameter server). A HELLO offering its
    ``peer_token`` opens a peer session (``Request.from_peer``), also on a server whose clients
    need the client token: the replicas of a slot share this secret, not the clients'."""

    @property
    def peer_token(self) -> str | None: ...


def _peer_token(extensions: Sequence[Extension]) -> str | None:
    tokens = {e.peer_token for e in extensions if isinstance(e, Replicated) and e.peer_token}
    if len(tokens) > 1:
        raise ValueError("the server's extensions name different peer tokens; a server has one")
    return tokens.pop() if tokens else None


class Server:
    """Serves one store on any number of addresses (``tcp://host:0`` binds a free port).

    It is a tensor store only: the parameter server (``PS_*`` opcodes, ALLREDUCE, gRPC
    ``GradientService``) is an extension, ``Server(extensions=[ps.ParamServer()])``, which
    ``tensorwire serve`` always adds. Without it, a ``ps.Worker`` gets PROTOCOL_ERROR (unknown
    opcode). It is not a default here on purpose: ``tensorwire.ps`` builds on this module, not the
    other way round.
    """

    def __init__(
        self,
        store: TensorStore | None = None,
        limits: Limits | None = None,
        *,
        stall_timeout: float = 60.0,
        security: Security | None = None,
        max_connections: int = 1024,
        idle_timeout: float = 900.0,
        auth_timeout: float = 5.0,
        extensions: Sequence[Extension] = (),
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        metrics_connections: int = 16,
        max_uploads: int = DEFAULT_MAX_UPLOADS,
        uploads_per_client: int = DEFAULT_UPLOADS_PER_CLIENT,
        resumable_min_bytes: int = DEFAULT_RESUMABLE_MIN_BYTES,
    ) -> None:
        self.store = store if store is not None else TensorStore()
        # Who this store is, for clients that cache by version (HELLO, docs/protocol.md §4.5): a
        # restarted in-memory server counts versions from 1 again, so a version alone names nothing.
        self.store_id = secrets.randbits(64) or 1
        self.extensions = list(extensions)
        self.handlers: dict[int, Handler] = {}
        for extension in self.extensions:
            self.handlers.update(extension.frame_handlers())
        self.limits = limits or Limits()
        # TLS files serve tls:// and grpcs:// addresses; a token is required on every connection.
        self.security = security or Security()
        self.peer_token = _peer_token(self.extensions)  # opens peer sessions (Replicated)
        if self.peer_token is not None and self.peer_token == self.security.token:
            raise ValueError("the peer token must differ from the clients' token: any client could replicate")
        # A peer that stops sending or reading in the middle of a request is cut off after this
        # many seconds without progress, and what it reserved is freed.
        self.stall_timeout = stall_timeout
        # Each connection holds a session and its read buffer: bound how many, and drop those idle
        # for idle_timeout seconds (a client reconnects on its next call without noticing).
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        # A connection holds its slot unauthenticated for at most this long: its TLS handshake and
        # its first frame (a HELLO with the token, when one is required) must be in by then.
        self.auth_timeout = auth_timeout
        self._listeners: list[Listener] = []
        self._sessions: set[_Session] = set()
        # Resumable and striped uploads: a bounded table, a quota per client, none for small puts
        # (uploads.py says how a full table makes room).
        self.uploads = Uploads(
            self.store,
            max_uploads,
            stall_timeout,
            per_client=uploads_per_client,
            min_bytes=resumable_min_bytes,
        )
        self._watchdog: asyncio.Task[None] | None = None
        # Metrics (metrics.py): plain counts always; the HTTP endpoint when a port is given
        # (0 picks a free one, which the STATUS answer reports).
        self.counts = metrics.RequestCounts()
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        # Scrapes served at once (a thread each); each must send its request within auth_timeout.
        self.metrics_connections = metrics_connections
        self.exporter: metrics.Exporter | None = None
        self._registry: Any = None
        self._started = time.time()

    @property
    def addresses(self) -> list[Address]:
        return [listener.address for listener in self._listeners]

    async def start(self, *urls: str) -> list[Address]:
        """Listen on every URL: ``tcp://`` and ``memory://`` speak the frame protocol, ``grpc://``
        serves ``TensorService`` (rpc.py); all share this server's store."""
        for url in urls:
            address = Address.parse(url)
            listen = LISTENERS.get(address.scheme)
            if listen is None:
                raise ValueError(f"cannot serve {address}: known schemes are {', '.join(LISTENERS)}")
            self._listeners.append(await listen(self, address))
            warning = exposure_warning(
                address.host, address.scheme in ("tls", "grpcs"), bool(self.security.token)
            )
            if warning and address.scheme != "memory":
                log.warning("%s: %s", address, warning)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        if self.metrics_port is not None and self.exporter is None:
            self.exporter = metrics.Exporter(
                self.registry,
                self._metrics_host(),
                self.metrics_port,
                max_connections=self.metrics_connections,
                timeout=self.auth_timeout,
            )
        event(log, logging.INFO, "server started", addresses=[str(a) for a in self.addresses],
              metrics=self.exporter.url if self.exporter else None, pid=os.getpid())  # fmt: skip
        return self.addresses

    @property
    def registry(self) -> Any:
        """This server's own ``prometheus_client.CollectorRegistry`` (built when first asked for)."""
        if self._registry is None:
            extra = [c for e in self.extensions if isinstance(e, metrics.Observed) for c in e.collectors()]
            self._registry = metrics.build_registry(self, extra)
        return self._registry

    def _metrics_host(self) -> str:
        """Where metrics are served: --metrics-host, else the host of the first network address."""
        if self.metrics_host:
            return self.metrics_host
        hosts = [a.host for a in self.addresses if a.scheme != "memory"]
        return hosts[0] if hosts else "127.0.0.1"

    def status(self) -> dict[str, Any]:
        """What the STATUS request answers (docs/protocol.md §11.9; ``tensorwire status`` shows it)."""
        store, counts = self.store, self.counts
        doc: dict[str, Any] = {
            "version": metrics._version(),
            "pid": os.getpid(),
            "uptime_s": time.time() - self._started,
            "addresses": [str(a) for a in self.addresses],
            "metrics": self.exporter.url if self.exporter else None,
            "store": {
                "tensors": len(store),
                "bytes": store.stored,
                "reserved": store.reserved,
                "capacity": store.capacity,
                "used": store.used,  # what counts against the capacity: all of the below
                "metadata": store.metadata,
                "pinned": store.pinned,
                "scratch": store.scratch_bytes,
                "max_tensors": store.max_tensors,
                "uploads": len(self.uploads),
            },
            "connections": counts.connections,
            "in_flight": counts.in_flight,
            "requests": sum(row.requests for row in list(counts.rows.values())),
        }
        for extension in self.extensions:
            if isinstance(extension, metrics.Observed):
                doc.update(extension.status())
        return doc

    async def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        for extension in self.extensions:
            await extension.close()
        self.uploads.close()
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        event(log, logging.INFO, "server stopped", pid=os.getpid())

    async def _watch(self) -> None:
        """Cut off sessions not admitted in time (``auth_timeout``), stalled mid-request
        (``stall_timeout``) or idle (``idle_timeout``)."""
        period = max(min(self.stall_timeout / 4, self.idle_timeout / 4, self.auth_timeout / 4, 5.0), 0.01)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self.uploads.expire(now)
            for session in list(self._sessions):
                quiet = now - session.stream.last_active
                if not session.admitted and now - session.opened > self.auth_timeout:
                    await self._close_unadmitted(session)
                elif session.busy and quiet > self.stall_timeout:
                    log.warning("closing %s: no progress for %.3gs mid-request", session.stream.peer, quiet)
                    await session.stream.close()
                elif not session.busy and quiet > self.idle_timeout:
                    log.info("closing %s: idle for %.3gs", session.stream.peer, quiet)
                    await session.stream.close()

    async def _close_unadmitted(self, session: _Session) -> None:
        """A connection did not finish its TLS handshake and send its first frame (authenticated,
        when a token is required) within ``auth_timeout``: its slot goes to someone else."""
        self.counts.refuse("auth_timeout")
        reason = f"not authenticated within {self.auth_timeout:.3g}s (--auth-timeout)"
        event(log, logging.WARNING, "connection closed", peer=session.stream.peer, reason=reason)
        await session.stream.close()

    async def handle(self, stream: ByteStream, transport: str = "tcp") -> None:
        """Serve one connection until the peer leaves or its bytes stop making frames."""
        session = _Session(self, stream, transport)
        if len(self._sessions) >= self.max_connections:
            self.counts.refuse("limit")
            event(log, logging.WARNING, "connection refused", peer=stream.peer, reason="limit",
                  connections=len(self._sessions))  # fmt: skip
            refusal = LimitExceeded(
                f"the server has {self.max_connections} connections already (--max-connections)"
            )
            # Within the auth deadline: over TLS the answer needs the peer's handshake first.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(session.send_error(0, refusal), self.auth_timeout)
            return
        self._sessions.add(session)
        self.counts.connections += 1
        try:
            await session.run()
        except ConnectionLost as exc:
            log.debug("session with %s ended: %s", stream.peer, exc)
        except Exception:
            log.exception("session with %s failed", stream.peer)
        finally:
            self.counts.connections -= 1
            self._sessions.discard(session)
            session.abort_batch()
            for state in session.states.values():
                close = getattr(state, "close", None)
                if close is not None:
                    close()


@dataclass(eq=False, slots=True)
class _Batch:
    request_id: int
    reservation: Reservation = field(default_factory=Reservation)
    error: TensorwireError | None = None


async def _listen_frames(server: Server, address: Address) -> Listener:
    if address.scheme == "tls":
        context = server_ssl_context(_tls_files(server, address))
        return await tls.listen(address, functools.partial(server.handle, transport="tls"), context)
    return await transport.listen(address, functools.partial(server.handle, transport=address.scheme))


async def _listen_rpc(server: Server, address: Address) -> Listener:
    from tensorwire.server import rpc as server_rpc  # grpcio loads only when gRPC is served

    files = _tls_files(server, address) if address.scheme == "grpcs" else None
    return await server_rpc.listen(
        address,
        server.store,
        server.limits,
        tls=files,
        token=server.security.token,
        stall_timeout=server.stall_timeout,
        extra_handlers=[h for extension in server.extensions for h in extension.rpc_handlers()],
        counts=server.counts,
        max_connections=server.max_connections,
        auth_timeout=server.auth_timeout,
        idle_timeout=server.idle_timeout,
    )


def _tls_files(server: Server, address: Address) -> TlsFiles:
    files = server.security.tls
    if files is None or files.cert is None or files.key is None:
        raise ValueError(f"serving {address} needs a TLS certificate and key (--tls-cert, --tls-key)")
    return files


async def _listen_shm(server: Server, address: Address) -> Listener:
    from tensorwire.server import shm as server_shm  # segments are set up only when shared memory is served

    return await server_shm.listen(server, address)


# The server's table of listeners, by scheme (the clients' table is tensorwire.transport.TRANSPORTS).
LISTENERS: dict[str, Callable[[Server, Address], Awaitable[Listener]]] = {
    "tcp": _listen_frames,
    "memory": _listen_frames,
    "tls": _listen_frames,
    "grpc": _listen_rpc,
    "grpcs": _listen_rpc,
    "shm": _listen_shm,
}


class _Session:
    def __init__(self, server: Server, stream: ByteStream, transport: str) -> None:
        self.server = server
        self.transport = transport
        self.counts = server.counts
        self.sent = 0  # the current request's response data bytes, and whether it failed (metrics)
        self.failed = False
        self.store = server.store
        self.limits = server.limits
        self.stream = stream
        self.handlers = server.handlers
        self.uploads = server.uploads
        self.reader = FrameReader(stream)
        self.version = PROTOCOL_VERSIONS[-1]
        self.data_read = False  # whether the current request's data section has been consumed
        self.batch: _Batch | None = None  # a PUT_MANY arriving in several frames
        self.in_request = False
        self.token = server.security.token
        self.authenticated = self.token is None
        # Until its first frame is in (and authenticated, where a token is required), a connection
        # has until ``opened + auth_timeout``: with a token or without, a peer that says nothing
        # (a stalled TLS handshake, a silent socket) does not keep its slot for the idle timeout.
        self.opened = time.monotonic()
        self.admitted = False
        self.peer = False  # a replica of this server's slot (its HELLO offered the peer token)
        self.working = False  # the server, not the peer, is what a request waits on (a disk write)
        self.encoder: lossless.Encoder | None = None  # how answers are compressed (HELLO; §5.5)
        self.states: dict[type, Any] = {}  # extensions' per-connection state (Request.session_state)

    @property
    def busy(self) -> bool:
        """In the middle of a request (or of a multi-frame batch): a stall here is not idleness."""
        return (self.in_request or self.batch is not None) and not self.working

    async def run(self) -> None:
        while await self.reader.at_frame_start():
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
            row = self.counts.begin(metrics.op_name(header.opcode), self.transport)
            self.sent, self.failed = 0, False
            try:
                await self._run_one(header, meta)
            finally:
                self.counts.end(row, header.data_len, self.sent, self.failed)
            self.in_request = False

    async def _run_one(self, header: Header, meta: bytes) -> None:
        self.data_read = False
        try:
            await self._dispatch(header, wm.MetaReader(meta, self.limits))
        except ConnectionLost:
            raise
        except TensorwireError as exc:
            if not self.data_read:
                await skip_data(self.reader, header)
            await self.send_error(header.request_id, exc, header.opcode)
        except Exception as exc:
            log.exception("request %d (%s) failed", header.request_id, _opname(header.opcode))
            if not self.data_read:
                await skip_data(self.reader, header)
            await self.send_error(header.request_id, exc, header.opcode)

    async def _dispatch(self, header: Header, reader: wm.MetaReader) -> None:
        op = header.opcode
        if self.batch is not None and (op != Opcode.PUT_MANY or header.request_id != self.batch.request_id):
            await self._interrupted(header)  # whatever the frame is, it broke the open batch
        if op not in OPCODES:
            raise ProtocolError(f"unknown opcode {op}")
        if header.flags & Flags.MORE and op != Opcode.PUT_MANY:
            raise ProtocolError(f"only PUT_MANY can span several frames, not {_opname(op)}")
        if op == Opcode.PUT_RESUMABLE:
            await self._put_resumable(header, reader)
            return
        if op in _STRIPED:
            await _STRIPED[op](self, header, reader)
            return
        if op == Opcode.STATUS:
            reader.done()
            if header.data_len:
                raise ProtocolError(f"STATUS carries no data, but the frame has {header.data_len} bytes")
            doc = self.server.status()
            doc["in_flight"] -= 1  # not counting the asker's own request
            await self.reply(header, wps.encode_stats(json.dumps(doc, sort_keys=True)))
            return
        handler = self.handlers.get(op)
        if handler is not None:
            await handler(Request(self, header, reader))
            if not self.data_read:  # a handler that answered without the data: keep the stream in step
                await skip_data(self.reader, header)
                self.data_read = True
            return
        if op >= Opcode.SHM_ATTACH:
            raise ProtocolError(f"this server serves no shared memory (no shm:// listener): {_opname(op)}")
        if op >= Opcode.PS_INIT:
            raise ProtocolError(f"this server does not serve {_opname(op)} (`tensorwire ps serve` does)")
        if op in (Opcode.PUT, Opcode.PUT_MANY):
            await self._put(header, reader)
            return
        if header.data_len:
            raise ProtocolError(f"{_opname(op)} carries no data, but the frame has {header.data_len} bytes")
        if op in (Opcode.GET, Opcode.GET_MANY):
            await self._get(header, reader)
        elif op == Opcode.HELLO:
            await self._hello(header, reader)
        elif op == Opcode.PING:
            reader.done()
            await self.reply(header, b"")
        elif op == Opcode.DELETE:
            names = await self._cpu(header.meta_len >= _OFF_LOOP_META, _names, reader)
            deleted = await self._on_disk(self.store.delete, names, big=len(names) >= _OFF_LOOP_TENSORS)
            await self.reply(header, struct.pack("<I", deleted))
        elif op == Opcode.STAT:
            await self.reply(header, wm.encode_records(self.store.stat(_names(reader))))
        elif op == Opcode.LIST:
            prefix, limit = wm.decode_list_request(reader)
            reader.done()
            limit = min(limit or self.limits.max_batch, self.limits.max_batch)
            await self.reply(header, wm.encode_records(self.store.list(prefix, limit)))

    async def _authenticate(self, header: Header, meta: bytes) -> bool:
        """The first frame of a connection to a server with a token must be a HELLO that carries
        it (or the peer token: a replica of its slot). Anything else gets one UNAUTHENTICATED error
        and the connection is closed, before any store operation runs."""
        offered = None
        if header.opcode == Opcode.HELLO:
            with contextlib.suppress(TensorwireError):
                offered = wm.decode_hello_request(wm.MetaReader(meta, self.limits))[2]
        if self.token is not None and (tokens_match(self.token, offered) or self._is_peer(offered)):
            self.authenticated = True
            return True
        why = "no token was offered" if offered is None else "the token is wrong"
        self.counts.refuse("auth")
        event(log, logging.WARNING, "connection refused", peer=self.stream.peer, reason=why)
        error = AuthenticationError(f"authentication failed: {why}")
        await self.send_error(header.request_id, error, header.opcode)
        return False

    def _is_peer(self, offered: str | None) -> bool:
        """Whether ``offered`` is the server's peer token (constant time; never without one)."""
        peer_token = self.server.peer_token
        return peer_token is not None and tokens_match(peer_token, offered)

    async def _hello(self, header: Header, reader: wm.MetaReader) -> None:
        lo, hi, offered, compression = wm.decode_hello_request(reader)
        wants = wm.decode_hello_wants(reader)
        reader.done()
        self.peer = self._is_peer(offered)  # each HELLO renegotiates, the session's role too
        common = [v for v in PROTOCOL_VERSIONS if lo <= v <= hi]
        if not common:
            raise UnsupportedVersion(f"client speaks versions {lo}..{hi}; server speaks {PROTOCOL_VERSIONS}")
        self.version = common[-1]
        self.encoder = _answer_encoder(compression)
        codecs = lossless.SUPPORTED_MASK
        info = wm.ServerInfo(self.version, self.limits, self.store.capacity, self.store.used, codecs,
                             store_id=self.server.store_id)  # fmt: skip
        answer = wm.encode_hello_response(info, with_codecs=compression is not None, wants=wants)
        await self.reply(header, answer)

    async def _put(self, header: Header, reader: wm.MetaReader) -> None:
        """A PUT, or one part of a PUT_MANY that arrives in several frames (flag MORE on all parts
        but the last, one request id): the parts are received as they come, while the client
        encodes the next, and committed together when the last one is in."""
        more = bool(header.flags & Flags.MORE)  # _dispatch allows it on PUT_MANY only
        batch = self.batch
        if batch is None:
            batch = self.batch = _Batch(header.request_id)
        try:
            if batch.error is None:
                await self._put_part(header, reader, batch)
        except TensorwireError as exc:
            if isinstance(exc, ConnectionLost):
                raise
            batch.error = exc  # keep taking the parts, so the stream stays in step; answer at the end
        if not self.data_read:  # a refused part, or any part after one: drop its data
            await skip_data(self.reader, header)
            self.data_read = True
        if not more:
            self.batch = None
            await self._finish_batch(header, batch)

    async def _put_part(self, header: Header, reader: wm.MetaReader, batch: _Batch) -> None:
        def reserve() -> Reservation:
            self.store.admit(reader.peek_count())  # before the records become objects
            metas = wm.decode_records(reader)
            reader.done()
            if header.opcode == Opcode.PUT and len(metas) != 1:
                raise ProtocolError(f"PUT cannot carry {len(metas)} tensors")
            if sum(m.nbytes for m in metas) != header.data_len:
                raise InvalidTensor("the tensor records' sizes do not add up to the frame's data length")
            return self.store.reserve(metas, batch.reservation)

        part = await self._cpu(header.meta_len >= _OFF_LOOP_META, reserve)
        await self.receive(header, part.buffers)

    async def _cpu(self, big: bool, fn: Callable[..., S], *args: object) -> S:
        """``fn(*args)`` with the cycle collector paused: here when it is small, on a worker thread
        when ``big`` (see _OFF_LOOP_META)."""
        if not big:
            with gc_paused():
                return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, _paused, fn, *args)

    async def receive(
        self, header: Header, buffers: Sequence[memoryview], verified: Callable[[int], None] | None = None
    ) -> None:
        """Read the data section into ``buffers``, every chunk verified; the section is consumed
        whatever happens, or the stream is gone. A compressed section's decoding scratch (sized by
        the data declared, not the chunk size) counts in the store's ``used`` meanwhile."""
        with self.store.scratch(compressed_scratch(header)):
            self.data_read = True
            await recv_data(self.reader, header, buffers, verified=verified)

    async def _on_disk(self, fn: Callable[..., S], *args: object, big: bool = False) -> S:
        """A store call that may block on the data directory (commit, delete): on the store's disk
        thread, so the loop serves others meanwhile; the stall watchdog leaves this request alone
        while the server, not the peer, is what it waits on. Without a data directory, as ``_cpu``."""
        if not self.store.persistent:
            return await self._cpu(big, fn, *args)
        self.working = True
        try:
            return await self.store.call(fn, *args)
        finally:
            self.working = False
            self.stream.last_active = time.monotonic()

    async def _finish_batch(self, header: Header, batch: _Batch) -> None:
        res = batch.reservation
        if batch.error is None and not res.metas:
            batch.error = ProtocolError("PUT_MANY carried no tensors")
        if batch.error is not None:
            self.store.abort(res)
            raise batch.error
        try:
            version = await self._on_disk(self.store.commit, res, big=len(res.metas) >= _OFF_LOOP_TENSORS)
        except BaseException:
            self.store.abort(res)
            raise
        await self.reply(header, _RID.pack(version))

    async def _put_resumable(self, header: Header, reader: wm.MetaReader) -> None:
        """One tensor from byte ``offset`` on, into the upload ``upload_id`` (uploads.py). With no
        data and offset ``RESUME_QUERY``, the answer is where to resume from."""
        upload_id, offset, metas = wm.decode_resumable(reader)
        reader.done()
        if len(metas) != 1:
            raise ProtocolError(f"PUT_RESUMABLE carries one tensor, not {len(metas)}")
        meta = metas[0]
        client = client_of(self.stream.peer)
        if offset == wm.RESUME_QUERY and not header.data_len:
            self.counts.upload_resumes += 1  # a client asks where to resume: it is retrying
            await self.reply(header, _RID.pack(self.uploads.resume_point(upload_id, meta, client)))
            return
        if offset + header.data_len != meta.nbytes or not header.data_len:
            raise InvalidTensor(
                f"bytes {offset}..{offset + header.data_len} are not the rest of {meta.name!r}"
            )
        if not self.uploads.slotted(meta):
            await self._put_unslotted(header, meta, offset)
            return
        upload = await self._claim(lambda: self.uploads.claim(upload_id, meta, offset, client))
        try:

            def verified(n: int) -> None:
                upload.verified += n

            await self.receive(header, [upload.buffer[offset:]], verified=verified)
        finally:
            self.uploads.release(upload)
        self.uploads.finish(upload)
        await self._finish_batch(header, _Batch(header.request_id, upload.reservation))

    async def _put_unslotted(self, header: Header, meta: TensorMeta, offset: int) -> None:
        """A PUT_RESUMABLE of a tensor under the server's resumable threshold: a plain put, with no
        upload state kept (a broken one is resumed from 0, which its client hears when it asks)."""
        if offset:
            raise ProtocolError(f"no upload here to resume {meta.name!r} at byte {offset} (start again at 0)")
        self.uploads.counts.unslotted += 1
        batch = _Batch(header.request_id, self.store.reserve([meta]))
        try:
            await self.receive(header, batch.reservation.buffers)
        except BaseException:
            self.store.abort(batch.reservation)
            raise
        await self._finish_batch(header, batch)

    async def _put_range(self, header: Header, reader: wm.MetaReader) -> None:
        """One byte range of a striped put (§11.7): into the upload's reservation, noted once every
        chunk of it is verified; nothing is visible before PUT_COMMIT."""
        upload_id, offset, metas = wm.decode_resumable(reader)
        reader.done()
        if len(metas) != 1:
            raise ProtocolError(f"PUT_RANGE carries one tensor, not {len(metas)}")
        client = client_of(self.stream.peer)
        upload = await self._claim(
            lambda: self.uploads.claim_range(upload_id, metas[0], offset, header.data_len, client)
        )
        ok = False
        try:
            await self.receive(header, [upload.buffer[offset : offset + header.data_len]])
            ok = True
        finally:
            self.uploads.range_done(upload, offset, ok)
        await self.reply(header, b"")

    async def _claim(self, claim: Callable[[], Upload]) -> Upload:
        """``claim()``; while another connection writes the same bytes, wait for it to let go (at
        most _BUSY_WAIT, or the stall timeout) and try again, then refuse (UploadBusy). A client
        retrying a range after its connection broke usually arrives before the server has seen the
        break; two live writers of the same bytes still never write at once."""
        deadline = time.monotonic() + min(_BUSY_WAIT, self.server.stall_timeout)
        while True:
            try:
                return claim()
            except UploadBusy as busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                busy.upload.on_release.append(functools.partial(_settle, released))
                self.working = True  # waiting on the server, not on the peer
                try:
                    await asyncio.wait_for(released, left)
                except TimeoutError:
                    pass
                finally:
                    self.working = False
                    self.stream.last_active = time.monotonic()

    async def _put_commit(self, header: Header, reader: wm.MetaReader) -> None:
        upload_id, _, metas = wm.decode_resumable(reader)
        reader.done()
        if len(metas) != 1 or header.data_len:
            raise ProtocolError("PUT_COMMIT names one tensor and carries no data")
        upload = self.uploads.complete(upload_id, metas[0], client_of(self.stream.peer))
        await self._finish_batch(header, _Batch(header.request_id, upload.reservation))

    async def _get_range(self, header: Header, reader: wm.MetaReader) -> None:
        """Bytes ``offset .. offset + length`` of one tensor, of ``version`` (VERSION_CHANGED if it
        has moved on), as one uint8 record of that length."""
        version, offset, length, names = wm.decode_get_range(reader)
        reader.done()
        if len(names) != 1 or header.data_len:
            raise ProtocolError("GET_RANGE names one tensor and carries no data")
        (entry,) = self.store.acquire(names)
        try:
            meta = entry.meta
            if version and meta.version != version:
                raise VersionChanged(f"{meta.name!r} is at version {meta.version} now, not {version}")
            if offset + length > meta.nbytes:
                raise InvalidTensor(f"bytes {offset}..{offset + length} are not inside {meta.name!r}")
            record = TensorMeta(meta.name, torch.uint8, (length,), length, meta.version)
            await self.reply(header, wm.encode_records([record]), [entry.data[offset : offset + length]])
        finally:
            self.store.release([entry])

    async def _interrupted(self, header: Header) -> None:
        """Another frame arrived in the middle of a multi-frame PUT_MANY: the client broke its own
        batch, so nothing of it can be trusted. Answer, then hang up."""
        self.abort_batch()
        await skip_data(self.reader, header)
        error = ProtocolError("a request interrupted a multi-frame PUT_MANY")
        await self.send_error(header.request_id, error, header.opcode)
        raise ConnectionLost("a client interrupted its own multi-frame PUT_MANY")

    def abort_batch(self) -> None:
        """Drop a multi-frame batch the connection died in the middle of."""
        if self.batch is not None:
            self.store.abort(self.batch.reservation)
            self.batch = None

    async def _get(self, header: Header, reader: wm.MetaReader) -> None:
        big = header.meta_len >= _OFF_LOOP_META
        names = await self._cpu(big, _names, reader)
        if not names or (header.opcode == Opcode.GET and len(names) != 1):
            raise ProtocolError(f"{_opname(header.opcode)} cannot ask for {len(names)} tensors")
        if len(set(names)) != len(names):  # one small tensor asked for 100,000 times is not a GET
            raise ProtocolError(f"{_opname(header.opcode)} names the same tensor twice")
        entries = await self._acquire(names, big)
        try:
            total = sum(e.meta.nbytes for e in entries)
            if total > self.limits.max_request_bytes:
                raise LimitExceeded(f"an answer of {total} bytes exceeds {self.limits.max_request_bytes}")
            records = await self._cpu(big, wm.encode_records, [e.meta for e in entries])
            await self.reply(header, records, [e.data for e in entries])
        finally:
            self.store.release(entries)

    async def _acquire(self, names: list[str], big: bool) -> list[Entry]:
        """Pin ``names`` (as ``_cpu``); pins taken by a worker thread after this request was
        cancelled are released, not leaked."""
        if not big:
            return self.store.acquire(names)
        pinning = asyncio.get_running_loop().run_in_executor(None, self.store.acquire, names)
        try:
            return await asyncio.shield(pinning)
        except asyncio.CancelledError:

            def unpin(done: asyncio.Future[list[Entry]]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self.store.release(done.result())

            pinning.add_done_callback(unpin)
            raise

    async def reply(self, req: Header, meta: bytes, data: Sequence[memoryview] = ()) -> None:
        data_len = sum(d.nbytes for d in data)
        self.sent += data_len
        # Answer in the client's checksum kind and chunk size when the server accepts them.
        kind = req.checksum if req.checksum in CHECKSUM_KINDS else ChecksumKind.XXH3_64
        lo, hi = self.limits.min_chunk_bytes, self.limits.max_chunk_bytes
        chunk = req.chunk_size if lo <= req.chunk_size <= hi else min(max(DEFAULT_CHUNK_BYTES, lo), hi)
        header = Header(
            self.version, req.opcode, Flags.RESPONSE, kind, req.request_id, len(meta),
            chunk if data_len else 0, data_len,
        )  # fmt: skip
        await send_frame(self.stream, header, meta, data, encoder=self.encoder)

    async def send_error(self, request_id: int, exc: BaseException, opcode: int = 0) -> None:
        self.failed = True
        if isinstance(exc, CorruptFrame):
            self.counts.checksum_failed(self.transport)
            event(log, logging.WARNING, "checksum failure", peer=self.stream.peer, op=_opname(opcode),
                  transport=self.transport, error=str(exc))  # fmt: skip
        message = str(exc) if isinstance(exc, TensorwireError) else f"internal error: {type(exc).__name__}"
        meta = wm.encode_error(code_for_error(exc), message)
        header = Header(self.version, opcode, Flags.RESPONSE | Flags.ERROR, 0, request_id, len(meta), 0, 0)
        with contextlib.suppress(ConnectionLost):
            await send_frame(self.stream, header, meta)


_STRIPED: dict[int, Callable[[_Session, Header, wm.MetaReader], Awaitable[None]]] = {
    Opcode.PUT_RANGE: _Session._put_range,
    Opcode.PUT_COMMIT: _Session._put_commit,
    Opcode.GET_RANGE: _Session._get_range,
}


def _answer_encoder(compression: wm.Compression | None) -> lossless.Encoder | None:
    """How to compress a connection's answers: the codec its HELLO asked for, if the client decodes
    it and this server has it; else raw."""
    if compression is None:
        return None
    mode = {int(code): mode for mode, code in lossless.MODE_CODES.items()}.get(compression.answers, "none")
    if mode == "none":
        return None
    encoder = lossless.Encoder(mode)
    return encoder if compression.accepts & (1 << encoder.codec) else None


def _names(reader: wm.MetaReader) -> list[str]:
    names = wm.decode_names(reader)
    reader.done()
    return names


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _paused(fn: Callable[..., S], *args: object) -> S:
    with gc_paused():
        return fn(*args)


def _request_id(raw: bytes) -> int:
    """The request id of a frame whose header failed its checks, so the client can match the error
    to its request (the server then closes the connection, which fails the client's others)."""
    return int(_RID.unpack_from(raw, 8)[0])


def _opname(op: int) -> str:
    try:
        return Opcode(op).name
    except ValueError:
        return f"opcode {op}"


class ServerThread:
    """A server running on its own event loop in a background thread (tests, embedding, demo).

    ``with ServerThread(["tcp://127.0.0.1:0"]) as srv: connect(srv.url)``.

    Like ``Server``, it is a tensor store only; a parameter server (what ``tensorwire serve`` runs)
    needs the extension: ``ServerThread(extensions=[ps.ParamServer()])``.
    """

    def __init__(
        self,
        urls: Sequence[str] = ("tcp://127.0.0.1:0",),
        store: TensorStore | None = None,
        limits: Limits | None = None,
        start_timeout: float = 10.0,
        security: Security | None = None,
        *,
        extensions: Sequence[Extension] = (),
        metrics_port: int | None = None,
    ) -> None:
        from tensorwire._aio import new_event_loop

        self.server = Server(
            store, limits, security=security, extensions=extensions, metrics_port=metrics_port
        )
        self._loop = new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(list(urls),), name="tensorwire-server", daemon=True
        )
        self._thread.start()
        if not self._started.wait(start_timeout):
            raise TimeoutError(f"server did not start within {start_timeout}s")
        if self._error is not None:
            raise self._error

    def _run(self, urls: list[str]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.start(*urls))
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self.server.close())
        self._loop.close()

    @property
    def addresses(self) -> list[Address]:
        return self.server.addresses

    @property
    def url(self) -> str:
        return str(self.addresses[0])

    def close(self, timeout: float = 10.0) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
