"""The client side of the tensorwire frame protocol over any ByteStream (TCP, in-process): HELLO and
the typed operations, each one request of the multiplexer under it (frame_mux.py: ids, the pending
table, deadlines, whoever reads the answers).

``FramedTransport`` is a ``Transport`` and a ``FrameChannel`` (``call``: any request).
``RangedTransport`` (ranged.py), the one tcp://, tls:// and memory:// open, carries the tensors'
bytes in its frames and so is also ``Ranged``, ``Resumable``, ``Generational`` and ``Lendable``
(its requests go through ``lending.Lending``, which may lend the connection to a thread);
``ShmTransport`` (shm.py) and ``RdmaTransport`` (rdma.py) build on ``FramedTransport`` and move
bytes through shared segments or the RDMA engine instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from tensorwire.errors import ConnectionLost, ProtocolError, UnsupportedVersion
from tensorwire.transport.base import ByteStream, Progress, PutBatch, Sink, Transport
from tensorwire.transport.frame_mux import FrameMux, Requests
from tensorwire.transport.framing import Framing
from tensorwire.types import Address, Generation, Limits, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import DEFAULT_CHUNK_BYTES, PROTOCOL_VERSIONS, Opcode

T = TypeVar("T")


class FramedTransport(Transport):
    """HELLO and the typed operations, each one request (``_request``) of the multiplexer."""

    def __init__(
        self,
        address: Address,
        stream: ByteStream,
        checksum: ChecksumKind = ChecksumKind.XXH3_64,
        chunk_size: int = DEFAULT_CHUNK_BYTES,
        timeout: float = 60.0,
        *,
        compression: str = "none",
    ) -> None:
        self.address = address
        self.compression = lossless.check_mode(compression)  # asked for; HELLO settles what is used
        self._stream = stream
        self._mux = FrameMux(address, stream, Framing(checksum, chunk_size), timeout)
        self._request = self._front(self._mux)  # what every operation calls
        self.info = wm.ServerInfo(PROTOCOL_VERSIONS[-1], Limits(), 0, 0)

    def _front(self, mux: FrameMux) -> Requests:
        """What the operations' requests go through: the multiplexer itself here; a transport that
        lends its connection puts its lending half in front of it (RangedTransport)."""
        return mux.request

    @property
    def closed(self) -> bool:
        return self._mux.closed

    @property
    def timeout(self) -> float:
        """Seconds one request may take, its send included (``call``'s ``timeout`` overrides it)."""
        return self._mux.timeout

    @property
    def encoder(self) -> lossless.Encoder | None:
        """How this side's puts are compressed (None: they are not), as HELLO settled."""
        return self._mux.framing.encoder

    @property
    def _checksum(self) -> ChecksumKind:
        return self._mux.framing.checksum

    @property
    def _chunk_size(self) -> int:
        return self._mux.framing.chunk_size

    async def hello(self, token: str | None = None) -> wm.ServerInfo:
        """Agree on a protocol version, authenticate with ``token``, learn the server's limits and
        its store's identity (``info.store_id``; 0 from a server that predates it)."""
        wants = wm.HELLO_WANTS_STORE_ID | wm.HELLO_WANTS_LOCATION
        info = await self._hello(token, self.compression != "none", wants)
        framing = self._mux.framing
        if info.codecs & (1 << lossless.Encoder(self.compression).codec) and self.compression != "none":
            framing.encoder = lossless.Encoder(self.compression)
        if info.version not in PROTOCOL_VERSIONS:
            raise UnsupportedVersion(f"server chose version {info.version}; we speak {PROTOCOL_VERSIONS}")
        framing.version = info.version
        framing.chunk_size = min(
            max(framing.chunk_size, info.limits.min_chunk_bytes), info.limits.max_chunk_bytes
        )
        self.info = info
        self._mux.max_inflight = info.limits.max_inflight
        return info

    async def _hello(self, token: str | None, compress: bool, wants: int = 0) -> wm.ServerInfo:
        versions = PROTOCOL_VERSIONS[0], PROTOCOL_VERSIONS[-1]
        asked = lossless.MODE_CODES[self.compression]
        compression = wm.Compression(lossless.SUPPORTED_MASK, asked) if compress else None
        hello = wm.encode_hello_request(*versions, token, compression, wants)
        try:
            _, reader = await self._request(Opcode.HELLO, hello, what="HELLO")
        except ProtocolError as exc:
            if isinstance(exc, UnsupportedVersion) or not (compress or wants):
                raise
            if wants:  # a server from before the wants field: ask as it understands
                return await self._hello(token, compress)
            return await self._hello(token, False)  # a server from before compression: raw it is
        return finish(reader, wm.decode_hello_response(reader))

    # -- operations ----------------------------------------------------------------------------
    async def put(self, batch: PutBatch, progress: Progress | None = None) -> int:
        op, what = put_request(batch)
        _, reader = await self._request(op, b"", batch=batch, progress=progress, what=what)  # no head
        return finish(reader, reader.u64())

    async def get(
        self, names: Sequence[str], sink: Sink, progress: Callable[[int], None] | None = None
    ) -> list[TensorMeta]:
        op, request, what = get_request(names)
        landed = Landed(sink)
        _, reader = await self._request(op, request, sink=landed, progress=progress, what=what)
        return finish(reader, landed.metas)

    async def delete(self, names: Sequence[str]) -> int:
        what = f"delete of {describe(names)}"
        _, reader = await self._request(Opcode.DELETE, wm.encode_names(names), what=what)
        return finish(reader, reader.u32())

    async def stat(self, names: Sequence[str]) -> list[TensorMeta]:
        _, reader = await self._request(
            Opcode.STAT, wm.encode_names(names), what=f"stat of {describe(names)}"
        )
        return finish(reader, wm.decode_records(reader))

    async def list(self, prefix: str, limit: int) -> list[TensorMeta]:
        request = wm.encode_list_request(prefix, limit)
        _, reader = await self._request(Opcode.LIST, request, what=f"list of {prefix!r}")
        return finish(reader, wm.decode_records(reader))

    async def ping(self) -> None:
        _, reader = await self._request(Opcode.PING, b"", what="ping")
        reader.done()

    async def call(
        self,
        opcode: int,
        meta: bytes,
        data: Sequence[memoryview] = (),
        sink: Sink | None = None,
        *,
        what: str,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> wm.MetaReader:
        """Any request as one frame: ``meta``, then ``data``; the answer's metadata comes back.

        With ``sink`` the answer's metadata must start with tensor records (the reader returned is
        past them) and its data lands in the buffers the sink hands out. ``timeout`` replaces the
        transport's own for this request (a parameter-server pull may wait for a whole step).
        """
        _, reader = await self._request(
            opcode, meta, data=data, sink=sink, what=what, timeout=timeout, progress=progress
        )
        return reader

    # GEN_WAIT: part of ``Generational`` (RangedTransport) and of ``GenerationViews`` (shm.py).
    async def wait(self, prefix: str, after: int, timeout: float) -> Generation:
        request = wg.encode_wait(prefix, after, max(1, round(timeout * 1000)))
        what = f"wait for a generation of {prefix!r} after {after}"
        # The server answers at ``timeout`` (WaitTimeout); this side's own timer only backs it up.
        _, reader = await self._request(Opcode.GEN_WAIT, request, what=what, timeout=timeout + self.timeout)
        return finish(reader, wg.decode_generation(reader))

    # GEN_PUBLISH_PART (``PartPublisher``): its bytes travel in frames (shm.py overrides it: segments).
    async def publish_part(
        self, prefix: str, batch: PutBatch, *, txn: bytes, index: int, count: int, timeout: float
    ) -> Generation:
        ms = max(1, min(round(timeout * 1000), 0xFFFFFFFF))
        head = wg.encode_part_head(wg.PartHead(prefix, txn, index, count, ms))
        what = f"part {index} of {count} of a publish under {prefix!r}"
        # The server answers once every part is in, or at ``timeout``; this timer only backs it up.
        _, reader = await self._request(
            Opcode.GEN_PUBLISH_PART, head, batch=batch, what=what, timeout=timeout + self.timeout
        )
        return finish(reader, wg.decode_generation(reader))

    async def close(self) -> None:
        await self._mux.fail(ConnectionLost(f"connection to {self.address} was closed by the client"))


def put_request(batch: PutBatch) -> tuple[int, str]:
    """A put's opcode, and how its errors name it."""
    return (Opcode.PUT if len(batch.names) == 1 else Opcode.PUT_MANY), f"put of {describe(batch.names)}"


def get_request(names: Sequence[str]) -> tuple[int, bytes, str]:
    """A get's opcode, its request's metadata, and how its errors name it."""
    op = Opcode.GET if len(names) == 1 else Opcode.GET_MANY
    return op, wm.encode_names(names), f"get of {describe(names)}"


class Landed:
    """A get's sink that keeps the records it is handed: they are decoded once, by whoever reads
    the answer, and are what the get returns."""

    __slots__ = ("_sink", "metas")

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self.metas: list[TensorMeta] = []

    def __call__(self, metas: list[TensorMeta]) -> list[memoryview]:
        self.metas = metas
        return self._sink(metas)


def describe(names: Sequence[str]) -> str:
    """How an error names the tensors of a request: the first, and how many more."""
    first = repr(names[0]) if names else "nothing"
    return first if len(names) <= 1 else f"{first} and {len(names) - 1} more"


def finish(reader: wm.MetaReader, value: T) -> T:
    """``value``, once nothing is left unread in the response's metadata block."""
    reader.done()
    return value
