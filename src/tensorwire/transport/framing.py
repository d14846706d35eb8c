"""How one client connection frames its requests: the header each carries, and the frames of a
request (``meta`` then ``data``) or of a put's batch, part by part. HELLO settles the protocol
version, the chunk size and the encoder (compressed puts) after the connection opens; the
multiplexer (frame_mux.py) and a borrowing thread (lending.py) send through the same ``Framing``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorwire.transport.base import Buffer, ByteStream, Progress, PutBatch
from tensorwire.transport.frame_io import send_frame
from tensorwire.transport.whole import one_buffer, whole_frame
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import PROTOCOL_VERSIONS, Flags, Header


@dataclass(slots=True)
class Framing:
    """How this connection frames its requests: HELLO settles the version, the chunk size and the
    encoder (compressed puts) after the connection opens."""

    checksum: ChecksumKind
    chunk_size: int
    version: int = PROTOCOL_VERSIONS[-1]
    encoder: lossless.Encoder | None = None

    def header(self, opcode: int, rid: int, meta: bytes, data_len: int, flags: int = 0) -> Header:
        # chunk_size is sent even without data: the server answers a GET in the same chunk size.
        return Header(self.version, opcode, flags, self.checksum, rid, len(meta), self.chunk_size, data_len)

    async def send(
        self,
        stream: ByteStream,
        opcode: int,
        rid: int,
        meta: bytes,
        *,
        batch: PutBatch | None,
        data: Sequence[Buffer],
        progress: Progress | None,
    ) -> None:
        """One request: ``meta`` then ``data`` in one frame, or a put's ``batch`` (``meta``: its head)."""
        if batch is not None:
            await self._send_batch(stream, opcode, rid, batch, progress=progress, head=meta)
            return
        header = self.header(opcode, rid, meta, sum(memoryview(d).nbytes for d in data))
        await send_frame(stream, header, meta, data, progress if data else None, encoder=self.encoder)

    def whole(
        self, opcode: int, rid: int, meta: bytes, *, batch: PutBatch | None, data: Sequence[Buffer]
    ) -> bytes | None:
        """The request ``send`` would send, as one buffer, when it is one small frame (no
        compression, at most one small chunk); None when it is not (``send`` sends it)."""
        if self.encoder is not None or (batch is not None and batch.parts != 1):
            return None
        metas, data = batch.part(0) if batch is not None else ((), data)
        data_len = sum(memoryview(d).nbytes for d in data)
        if not one_buffer(data_len, self.chunk_size):
            return None  # before its records are encoded: ``send`` encodes them
        if batch is not None:
            meta += wm.encode_records(metas)
        return whole_frame(self.header(opcode, rid, meta, data_len), meta, data)

    async def _send_batch(
        self,
        stream: ByteStream,
        opcode: int,
        rid: int,
        batch: PutBatch,
        *,
        progress: Progress | None,
        head: bytes,
    ) -> None:
        """Send a put as one frame, or as several (flag MORE on all but the last) when the batch has
        several parts: the server takes part k while this side encodes part k+1. Each part's
        metadata block is ``head`` (a GEN_PUBLISH's prefix), then its records."""
        for i in range(batch.parts):
            metas, data = batch.part(i)
            meta = head + wm.encode_records(metas)
            flags = 0 if i == batch.parts - 1 else Flags.MORE
            header = self.header(opcode, rid, meta, sum(d.nbytes for d in data), flags)
            await send_frame(stream, header, meta, data, progress, encoder=self.encoder)
