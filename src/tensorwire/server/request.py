"""The seam between the frame loop and the operations it serves: ``Request``, ``Handler``,
``Extension``.

Lifecycle of one frame (session.py drives it, docs/protocol.md §5):

1. The session reads and checks the header and the metadata block, then builds a ``Request``.
2. It looks the opcode up in the server's one table (``Server.handlers``: the store's own
   operations, store_ops.py, and every extension's ``frame_handlers()``) and awaits the handler.
3. The handler reads ``meta``, then either ``receive``s the data section into buffers of its own
   (every chunk verified before it returns) or ``skip``s it, and answers once with ``reply``.
   Raising a ``TensorwireError`` answers with an ERROR frame instead.
4. Whatever the handler did, the session calls ``finish()``: a data section nobody read is skipped
   there, so the stream stays cut into frames. The request, not the session, knows whether its
   data was read, so no path can forget it.

An ``Extension`` is asked for its handlers once, when the server is built (or, for shm://, when the
first such listener starts: ``Server.extend``), and closed once, when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from tensorwire.errors import ProtocolError
from tensorwire.security import tokens_match
from tensorwire.store import TensorStore
from tensorwire.transport.base import Buffer, ByteStream
from tensorwire.transport.frame_io import (
    FrameReader,
    compressed_scratch,
    recv_data,
    send_frame,
    skip_data,
)
from tensorwire.transport.whole import copy_chunk, goes_whole, whole_frame
from tensorwire.types import Limits
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import CHECKSUM_KINDS, DEFAULT_CHUNK_BYTES, Flags, Header, Opcode

S = TypeVar("S")
E = TypeVar("E")


class Spanning(Protocol):
    """A request whose parts arrive in several frames (a PUT_MANY with flag MORE): open on its
    connection from its first part to its last. Its connection aborts it if it dies meanwhile."""

    request_id: int

    def abort(self) -> None: ...


class Connection(Protocol):
    """What a request reads and sets of the connection it came in on (session.py's ``Session``).

    Extensions go through ``Request``'s methods; the store's own operations (store_ops.py) also
    renegotiate it (HELLO sets ``version``, ``encoder``, ``from_peer``) and keep a multi-frame
    PUT_MANY open on it (``spanning``)."""

    stream: ByteStream
    reader: FrameReader
    transport: str  # the kind of listener: "tcp", "tls", "shm", "memory"
    store: TensorStore
    limits: Limits
    version: int  # the protocol version answers are sent in
    encoder: lossless.Encoder | None  # how answers are compressed (HELLO; §5.5)
    from_peer: bool  # its HELLO offered the peer token (``Replicated``)
    working: bool  # the server, not the peer, is what the request waits on (watchdog)
    spanning: Spanning | None
    states: dict[type, Any]  # extensions' per-connection state (``Request.session_state``)
    write_lock: asyncio.Lock  # held while a frame goes out: answers sent later keep frames whole

    async def send_error(self, request_id: int, exc: BaseException, opcode: int = 0) -> None: ...


class Request:
    """One request: its header, its metadata block, and its data section, read at most once.

    See the module docstring for the order of calls. ``sent`` counts the answer's data bytes
    (metrics)."""

    __slots__ = ("_conn", "_data_read", "_in_buffer", "header", "meta", "sent")

    def __init__(
        self, conn: Connection, header: Header, meta: wm.MetaReader, in_buffer: memoryview | None = None
    ) -> None:
        self._conn = conn
        self.header = header
        self.meta = meta
        self.sent = 0
        self._data_read = False
        # The data section (one chunk and its trailer) whole in the session's read buffer: a
        # request served from the loop's readiness callback (``ReadyHandler``), valid while it runs.
        self._in_buffer = in_buffer

    @property
    def connection(self) -> Connection:
        return self._conn

    @property
    def peer(self) -> str:
        return self._conn.stream.peer

    @property
    def transport(self) -> str:
        """The kind of listener the request came in on ("tcp", "tls", "shm", "memory"): an opcode
        that belongs to one transport checks it before anything else."""
        return self._conn.transport

    @property
    def from_peer(self) -> bool:
        """Whether the connection is a peer session: its HELLO offered the server's peer token (a
        replica of the same slot), so it may send replication requests."""
        return self._conn.from_peer

    def session_state(self, key: type[S]) -> S:
        """This connection's instance of ``key`` (made with ``key()`` on first use): an extension's
        per-connection state. Its ``close()``, if it has one, runs when the connection ends."""
        states = self._conn.states
        state = states.get(key)
        if state is None:
            state = states[key] = key()
        return state

    async def receive(
        self, buffers: Sequence[memoryview], verified: Callable[[int], None] | None = None
    ) -> None:
        """Read the data section into ``buffers`` (their sizes must add up to its length), every
        chunk verified; ``verified(n)`` hears of each verified run of bytes. The section is consumed
        whatever happens, or the stream is gone. A compressed section's decoding scratch (sized by
        the data declared, not the chunk size) counts in the store's ``used`` meanwhile."""
        conn = self._conn
        with conn.store.scratch(compressed_scratch(self.header)):
            self._data_read = True
            await recv_data(conn.reader, self.header, buffers, verified=verified)

    def receive_now(self, buffers: Sequence[memoryview]) -> None:
        """``receive`` for a ``ReadyHandler``: the section's one chunk, checked in the read buffer
        (CorruptFrame: nothing is copied), then copied into ``buffers``."""
        data, self._data_read = self._in_buffer, True
        if data is None:
            raise ProtocolError("this request's data is not in the read buffer")
        copy_chunk(self.header, data, buffers)

    async def skip(self) -> None:
        """Drop the data section unread (nothing, once it was read or skipped)."""
        if not self._data_read:
            self._data_read = True
            await skip_data(self._conn.reader, self.header)

    async def finish(self) -> None:
        """The session's last word on the request: skip its data section if nobody read it."""
        await self.skip()

    async def reply(self, meta: bytes, data: Sequence[Buffer] = ()) -> None:
        """Answer, in the client's checksum kind and chunk size when the server accepts them. ``data``
        is byte buffers: views, or a stored tensor's own ``bytearray`` (``Entry.payload``)."""
        conn = self._conn
        header = self._answer(meta, data)
        self.sent += header.data_len
        async with conn.write_lock:
            await send_frame(conn.stream, header, meta, data, encoder=conn.encoder)

    def answer_now(self, meta: bytes, data: Sequence[Buffer] = ()) -> bytes | None:
        """``reply``'s frame as one buffer, for a handler run from the loop's readiness callback
        (``ReadyHandler``), which sends it; None when the answer is not one small plain frame
        (large, or compressed): the handler then leaves the request to its task."""
        header = self._answer(meta, data)
        if not goes_whole(header, self._conn.encoder):
            return None
        self.sent += header.data_len
        return whole_frame(header, meta, data)

    def _answer(self, meta: bytes, data: Sequence[Buffer]) -> Header:
        conn, req = self._conn, self.header
        data_len = sum(d.nbytes if type(d) is memoryview else len(d) for d in data)
        kind = req.checksum if req.checksum in CHECKSUM_KINDS else ChecksumKind.XXH3_64
        lo, hi = conn.limits.min_chunk_bytes, conn.limits.max_chunk_bytes
        chunk = req.chunk_size if lo <= req.chunk_size <= hi else min(max(DEFAULT_CHUNK_BYTES, lo), hi)
        return Header(
            conn.version, req.opcode, Flags.RESPONSE, kind, req.request_id, len(meta),
            chunk if data_len else 0, data_len,
        )  # fmt: skip

    async def reply_error(self, exc: BaseException) -> None:
        """Answer with an ERROR frame for ``exc`` (a handler that answers later, from a task of its
        own, after the session has moved on to the next frames)."""
        await self._conn.send_error(self.header.request_id, exc, self.header.opcode)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """While inside, the request waits on the server (other workers, a step, a disk write), not
        on its peer: the stall watchdog leaves the connection alone."""
        conn = self._conn
        conn.working = True
        try:
            yield
        finally:
            conn.working = False
            conn.stream.last_active = time.monotonic()


Handler = Callable[[Request], Awaitable[None]]
# A handler's form for the loop's readiness callback (session.py): the whole answer frame
# (``Request.answer_now``), or None, having done nothing, to leave the request to ``Handler``.
# Its data section, if any, is one chunk whole in the read buffer (``Request.receive_now``);
# nothing here waits.
ReadyHandler = Callable[[Request], bytes | None]


class Extension(Protocol):
    """More operations on the same listeners: the parameter server is one (``tensorwire.ps``),
    shared memory another (server/shm.py, added by the first shm:// listener).

    Lifecycle: built by its owner and handed to ``Server(extensions=...)``; the server asks once for
    ``frame_handlers()`` (they join ``Server.handlers``; an opcode served twice is refused) and, for
    each grpc:// listener, for ``rpc_handlers()``; it awaits ``close()`` once when it stops, after
    its listeners are closed. One that also has ``collectors()`` and ``status()``
    (``metrics.Observed``) adds Prometheus families to the server's registry and a part to its
    STATUS answer."""

    def frame_handlers(self) -> Mapping[int, Handler]:
        """Opcode -> handler, for the frame protocol (tcp://, tls://, memory://, shm://)."""
        ...

    def rpc_handlers(self) -> Sequence[Any]:
        """``grpc.GenericRpcHandler`` objects served next to TensorService on grpc:// addresses."""
        ...

    async def close(self) -> None:
        """The server stops: finish (a parameter server writes its last checkpoint)."""
        ...


@runtime_checkable
class Attached(Protocol):
    """An extension that needs the server it joins (the parameter server publishes its parameters
    into the server's generations for relay pulls, and adds the relay's coordinator):
    ``Server.extend`` calls ``added_to(server)`` once, after the extension's handlers joined the
    table. ``server`` is the ``Server`` (typed loosely: core.py builds on this module)."""

    def added_to(self, server: Any) -> None: ...


@runtime_checkable
class Started(Protocol):
    """An extension with work of its own once the server listens (the parameter server's
    leadership campaigns for its slot's lease): ``Server.start`` awaits ``started(server)`` after
    each start's listeners are up; it must be idempotent."""

    async def started(self, server: Any) -> None: ...


@runtime_checkable
class Replicated(Protocol):
    """An extension whose replicas talk to each other (the parameter server). A HELLO offering its
    ``peer_token`` opens a peer session (``Request.from_peer``), also on a server whose clients
    need the client token: the replicas of a slot share this secret, not the clients'."""

    @property
    def peer_token(self) -> str | None: ...


def extension_of(extensions: Sequence[Extension], kind: type[E]) -> E | None:
    """The server's extension of type ``kind``, if it has one (shm:// and rdma:// keep one service
    per server, which their first listener adds: ``Server.extensions`` is where it is found)."""
    return next((e for e in extensions if isinstance(e, kind)), None)


def listener_only(scheme: str, table: Mapping[int, Handler]) -> dict[int, Handler]:
    """``table``'s handlers, each refusing (ProtocolError, before anything happens) a request that
    did not come in on a ``scheme``:// listener: a tcp:// (or tls://) connection of the same server
    may come from anywhere, so it may not reserve shared segments, register memory with the RDMA
    engine, pin either or learn a probe's token."""

    def guard(op: int, handler: Handler) -> Handler:
        async def guarded(req: Request) -> None:
            if req.transport != scheme:
                where = f"the {scheme}:// listener, not on {req.transport}://"
                raise ProtocolError(f"{opname(op)} is served only on {where}")
            await handler(req)

        return guarded

    return {op: guard(op, handler) for op, handler in table.items()}


def peer_token_of(extensions: Sequence[Extension]) -> str | None:
    """The one peer token the server's ``Replicated`` extensions name, if any."""
    tokens = {e.peer_token for e in extensions if isinstance(e, Replicated) and e.peer_token}
    if len(tokens) > 1:
        raise ValueError("the server's extensions name different peer tokens; a server has one")
    return tokens.pop() if tokens else None


def is_peer_token(peer_token: str | None, offered: str | None) -> bool:
    """Whether ``offered`` is the server's peer token (constant time; never without one)."""
    return peer_token is not None and tokens_match(peer_token, offered)


def opname(op: int) -> str:
    """An opcode's name for messages and logs (``opcode 99`` for one this build does not know)."""
    try:
        return Opcode(op).name
    except ValueError:
        return f"opcode {op}"
