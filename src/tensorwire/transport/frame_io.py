"""Frames over a ByteStream: buffered reads that land in their destination, chunked checksummed
writes from memoryviews. Shared by the client transport and the server.

The data section of a frame is the concatenation of its tensors' bytes, cut into chunks of
``chunk_size`` bytes, each followed by an 8-byte checksum. A chunk may span several tensors (many
small ones) and a tensor may span many chunks (a large one); both sides walk the same cut, so a
chunk is checked as it arrives, wherever its bytes land (the cut itself: chunks.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

from tensorwire.errors import ConnectionLost, CorruptFrame
from tensorwire.transport import chunks as cut
from tensorwire.transport.base import Buffer, ByteStream, StagedData
from tensorwire.transport.plain import LentStream, ReadyIO
from tensorwire.transport.whole import TRAILER, compressed_frame, one_buffer, whole_frame
from tensorwire.wire import lossless
from tensorwire.wire.checksum import checksum
from tensorwire.wire.frame import (
    HEADER_BYTES,
    TRAILER_BYTES,
    Flags,
    Header,
    chunk_count,
    encode_frame_head,
)
from tensorwire.wire.views import copy_out

_COMPRESSED = int(Flags.COMPRESSED)

Notify = tuple[Callable[[int], None] | None, Callable[[int], None] | None]  # (progress, verified)
READ_BUFFER = 256 << 10  # reads smaller than this go through the buffer; larger ones land directly
_MAX_IOV = 512  # stay well under IOV_MAX per sendmsg
# A stream read or written while its socket keeps up never waits, so a large frame would hold the
# event loop from its first byte to its last (a 1 GiB put froze every other connection for over a
# second). Past YIELD_BYTES, once YIELD_SECONDS have gone by without a turn, the frame's coroutine
# gives the loop one turn: others wait about a millisecond at most, and a slow stream, which waits
# for its bytes anyway, is not slowed by turns it does not need.
YIELD_BYTES = 1 << 20
YIELD_SECONDS = 0.001
_COPY_OUT_TENSORS = 512  # small tensors copied out of a staging buffer between the loop's turns
# One receive syscall into fresh pages runs at the page-fault rate (well under 1 GB/s here): a
# socket buffer of 8 MiB drained into a new 1 GiB tensor in one call held the loop for ~50 ms.
# Reads into a caller's buffer go in slices of at most this much, each a short hold.
RECV_SLICE = 1 << 20
# Decoding a compressed chunk this large runs on a worker thread (lz4 and zstd release the GIL):
# a 64 MiB zstd chunk takes ~60 ms to decode, which the loop's other connections must not wait for.
DECODE_OFF_LOOP = 1 << 20


class Turns:
    """When a long stretch of stream work should give the event loop a turn (see YIELD_SECONDS)."""

    __slots__ = ("_bytes", "_since")

    def __init__(self) -> None:
        self._bytes = 0
        self._since = time.perf_counter()

    def reset(self) -> None:
        """The coroutine waited anyway (for a new frame, say): its stretch starts again."""
        self._bytes = 0
        self._since = time.perf_counter()

    async def moved(self, nbytes: int) -> None:
        """``nbytes`` more were moved; take a turn if the stretch has gone on long enough."""
        self._bytes += nbytes
        if self._bytes >= YIELD_BYTES and time.perf_counter() - self._since >= YIELD_SECONDS:
            await asyncio.sleep(0)
            self.reset()


class FrameReader:
    """Exact-size reads from a stream; large reads go straight into the caller's buffer."""

    __slots__ = ("_buf", "_end", "_pos", "_stream", "_turns", "_view", "received")

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._buf = bytearray(READ_BUFFER)
        self._view = memoryview(self._buf)
        self._pos = 0
        self._end = 0
        self.received = 0
        self._turns = Turns()

    @property
    def buffered(self) -> int:
        """Bytes read off the stream and not yet handed out."""
        return self._end - self._pos

    def switch(self, stream: ByteStream) -> None:
        """Read from ``stream`` from now on (a lent connection's twin, and back: lending.py)."""
        self._stream = stream

    async def readinto(self, dest: memoryview) -> None:
        """Fill ``dest`` completely; ConnectionLost if the stream ends first."""
        want = dest.nbytes
        have = self._end - self._pos
        if have >= want:
            dest[:] = self._view[self._pos : self._pos + want]
            self._pos += want
            return
        dest[:have] = self._view[self._pos : self._end]
        self._pos = self._end = 0
        filled = have
        while filled < want:
            if want - filled >= READ_BUFFER:
                filled += await self._recv(dest[filled : filled + RECV_SLICE])
                continue
            got = await self._recv(self._view)
            take = min(got, want - filled)
            dest[filled : filled + take] = self._view[:take]
            filled += take
            self._pos, self._end = take, got

    async def read(self, n: int) -> bytes:
        if self._end - self._pos >= n:  # the usual case: the bytes are already buffered
            start = self._pos
            self._pos = start + n
            return bytes(self._view[start : self._pos])
        # Grow with what arrives, not with what a header promised: a peer that announces a large
        # block and sends a byte must not make us hold the whole block.
        buf = bytearray()
        while len(buf) < n:
            piece = bytearray(min(n - len(buf), 1 << 20))
            await self.readinto(memoryview(piece))
            buf += piece
        return bytes(buf)

    # -- a borrowing thread's reads (lending.py): plain calls on a ``LentStream`` -----------------
    def fill_now(self, stream: LentStream, n: int) -> bool:
        """Have at least ``n`` bytes buffered, receiving from ``stream`` with plain calls; False if
        ``n`` bytes cannot fit the buffer (nothing is read then). ConnectionLost if the stream ends."""
        if self._end - self._pos >= n:
            return True
        if n > READ_BUFFER:
            return False
        if self._pos + n > READ_BUFFER:  # make room at the end: move what is left to the front
            have = self._end - self._pos
            self._buf[:have] = self._buf[self._pos : self._end]
            self._pos, self._end = 0, have
        while self._end - self._pos < n:
            got = stream.recv_now(self._view[self._end :])
            if got == 0:
                raise ConnectionLost(f"{stream.peer} closed the connection")
            self.received += got
            self._end += got
        return True

    def peek(self, n: int) -> memoryview:
        """The next ``n`` buffered bytes, left in the buffer (``fill_now`` made sure they are)."""
        return self._view[self._pos : self._pos + n]

    def take(self, n: int) -> memoryview:
        """The next ``n`` buffered bytes, taken: valid until the next read."""
        start = self._pos
        self._pos = start + n
        return self._view[start : self._pos]

    def pull(self, io: ReadyIO) -> int | None:
        """One receive into the empty buffer from a readiness callback (``ByteStream.serve_idle``):
        how many bytes came (0: the peer closed), None if none were there."""
        self._pos = self._end = 0
        got = io.try_recv(self._view)
        if got:
            self._end = got
            self.received += got
        return got

    async def at_frame_start(self) -> bool:
        """Wait for the next frame; False if the peer closed the stream cleanly between frames."""
        self._turns.reset()
        if self._end > self._pos:
            return True
        got = await self._stream.recv_into(self._view)
        self.received += got
        self._pos, self._end = 0, got
        return got > 0

    async def _recv(self, dest: memoryview) -> int:
        got = await self._stream.recv_into(dest)
        if got == 0:
            raise ConnectionLost(f"{self._stream.peer} closed the connection in the middle of a frame")
        self.received += got
        await self._turns.moved(got)
        return got


async def read_head(reader: FrameReader) -> bytes:
    return await reader.read(HEADER_BYTES)


async def send_frame(
    stream: ByteStream,
    header: Header,
    meta: bytes,
    segments: Sequence[Buffer] = (),
    progress: Callable[[int], None] | None = None,
    *,
    encoder: lossless.Encoder | None = None,
) -> None:
    """Write one whole frame: header, metadata, then the data chunks with their checksums.

    With an ``encoder`` (the connection negotiated compression) a data section of at least
    ``lossless.MIN_FRAME_BYTES`` goes out with flag COMPRESSED, each chunk compressed or raw.
    ``segments`` that are ``StagedData`` are read only once ready, chunk by chunk.
    """
    # A plain list or tuple (every caller but CUDA staging) skips the protocol check's cost.
    staged = None if type(segments) in (list, tuple) or not isinstance(segments, StagedData) else segments
    compressed = compressed_frame(header, encoder)
    if compressed:
        header.flags |= _COMPRESSED
    if not compressed and one_buffer(header.data_len, header.chunk_size):
        if staged is not None and header.data_len:
            await staged.ready(header.data_len)
        await stream.send([whole_frame(header, meta, segments)])
        if progress is not None and header.data_len:
            progress(header.data_len)
        return
    head = encode_frame_head(header, meta)
    await _send_chunks(
        stream, head, header, segments, progress, encoder=encoder if compressed else None, staged=staged
    )


async def _send_chunks(
    stream: ByteStream,
    head: bytes,
    header: Header,
    segments: Sequence[Buffer],
    progress: Callable[[int], None] | None,
    *,
    encoder: lossless.Encoder | None,
    staged: StagedData | None = None,
) -> None:
    """The data section chunk by chunk, each followed by its checksum trailer; with an ``encoder``
    each chunk is preceded by a chunk head and sent compressed or raw (the trailer is always over
    the raw bytes). ``staged``: each chunk's bytes are awaited before they are read."""
    views: Iterable[memoryview] = (
        iter(staged) if staged is not None else cut.coalesced(segments, header.chunk_size)
    )
    reached = 0  # bytes of the data section read so far (for ``staged``)
    chunks = encoder.frame() if encoder is not None else None
    out: list[Buffer] = [head]
    pending = wire = 0
    spent = 0.0  # seconds in the stream's send, for the link meter that auto weighs codecs against
    turns = Turns()
    for pieces in cut.pieces(views, header.chunk_size):
        if staged is not None:
            reached += sum(p.nbytes for p in pieces)
            await staged.ready(reached)
        digest = TRAILER.pack(cut.digest(header.checksum, pieces))
        if chunks is None:
            out += pieces
        else:
            codec, body = chunks.encode(pieces)
            length = sum(memoryview(b).nbytes for b in body)
            out.append(lossless.CHUNK_HEAD.pack(codec, length))
            out += body
            wire += length
        out.append(digest)
        pending += sum(p.nbytes for p in pieces)
        if len(out) >= _MAX_IOV or pending >= header.chunk_size:
            start = time.perf_counter()
            await stream.send(out)
            spent += time.perf_counter() - start
            if progress is not None:
                progress(pending)
            await turns.moved(pending)
            out, pending = [], 0
    if out:
        await stream.send(out)
    if progress is not None and pending:
        progress(pending)
    if encoder is not None:
        encoder.link.observe(wire, spent)


async def recv_data(
    reader: FrameReader,
    header: Header,
    segments: Sequence[memoryview],
    progress: Callable[[int], None] | None = None,
    verified: Callable[[int], None] | None = None,
) -> None:
    """Read the data section into ``segments``, checking every chunk as it lands.

    ``verified`` is told the size of each chunk that checked out, as long as every chunk before it
    did too and its bytes are in place (not staged): a resumable put's verified prefix.

    The whole section is always consumed, so the stream stays in step; a bad chunk raises
    CorruptFrame only after that. The caller must not expose ``segments`` if this raises. Runs of
    small segments are received into one staging buffer and copied out once verified.
    """
    if not header.data_len:
        return  # no chunks, no trailers
    if header.flags & _COMPRESSED:
        await _recv_compressed(reader, header, segments, (progress, verified))
        return
    trailer = bytearray(TRAILER_BYTES)
    tview = memoryview(trailer)
    if len(segments) == 1 and header.data_len <= header.chunk_size:  # one tensor, one chunk
        await reader.readinto(segments[0])
        await reader.readinto(tview)
        if progress is not None:
            progress(header.data_len)
        if TRAILER.unpack(trailer)[0] != checksum(header.checksum, segments[0]):
            raise CorruptFrame(f"corrupt chunk in request {header.request_id}; nothing was kept")
        if verified is not None:
            verified(header.data_len)
        return
    views, staged = cut.runs(segments)
    bad = 0
    for pieces in cut.pieces(views, header.chunk_size):
        for piece in pieces:
            await reader.readinto(piece)
        await reader.readinto(tview)
        good = TRAILER.unpack(trailer)[0] == cut.digest(header.checksum, pieces)
        bad = _checked(good, sum(p.nbytes for p in pieces), bad, not staged, (progress, verified))
    await _finish_recv(header, bad, staged)


def _checked(good: bool, size: int, bad: int, in_place: bool, notify: Notify) -> int:
    """A chunk of ``size`` bytes checked (``good``): how many were bad so far. ``verified`` hears of
    a good one while every one before it was good and its bytes are in place; ``progress`` of all."""
    progress, verified = notify
    if not good:
        bad += 1
    elif verified is not None and not bad and in_place:
        verified(size)
    if progress is not None:
        progress(size)
    return bad


async def _finish_recv(header: Header, bad: int, staged: list[tuple[memoryview, list[memoryview]]]) -> None:
    """Raise for bad chunks, else copy staged runs out to their segments; the copy of a batch of
    100,000 small tensors takes ~100 ms, so it gives the loop a turn every ~millisecond."""
    if bad:
        raise CorruptFrame(f"{bad} corrupt chunk(s) in request {header.request_id}; nothing was kept")
    turns = Turns()
    for buf, run in staged:
        pos = 0
        for first in range(0, len(run), _COPY_OUT_TENSORS):
            pos = copy_out(buf, run, first, first + _COPY_OUT_TENSORS, pos)
            await turns.moved(YIELD_BYTES)  # ask about the time, whatever the bytes


async def _chunk_head(reader: FrameReader, head: memoryview, size: int) -> tuple[int, int]:
    """A compressed section's chunk head, checked: its length must fit the chunk it stands for."""
    await reader.readinto(head)
    codec, wire = lossless.CHUNK_HEAD.unpack(head)
    if wire > size or (codec != lossless.Codec.RAW and wire == size):
        # The stream can no longer be cut into chunks: this connection is done.
        raise ConnectionLost(f"a chunk head announces {wire} bytes for a {size}-byte chunk (codec {codec})")
    return codec, wire


async def _recv_compressed(
    reader: FrameReader,
    header: Header,
    segments: Sequence[memoryview],
    notify: Notify,
) -> None:
    """``recv_data`` for a section with chunk heads: raw chunks land in place, compressed ones are
    read into a scratch buffer and decoded into place; the trailer checks the decoded bytes."""
    views, staged = cut.runs(segments)
    head = memoryview(bytearray(lossless.CHUNK_HEAD.size))
    trailer = bytearray(TRAILER_BYTES)
    tview = memoryview(trailer)
    scratch: memoryview | None = None
    bad = 0
    for pieces in cut.pieces(views, header.chunk_size):
        size = sum(p.nbytes for p in pieces)
        codec, wire = await _chunk_head(reader, head, size)
        ok = True
        if codec == lossless.Codec.RAW:
            if wire != size:
                raise ConnectionLost(f"a raw chunk of {wire} bytes stands for {size}")
            for piece in pieces:
                await reader.readinto(piece)
        else:
            # Sized by the largest chunk this frame can have, not by the chunk size it declares: a
            # 4 KiB put that declares 64 MiB chunks must not cost 64 MiB (see compressed_scratch).
            scratch = scratch if scratch is not None else memoryview(bytearray(_largest_chunk(header)))
            await reader.readinto(scratch[:wire])
            ok = await _decode_into(codec, scratch[:wire], pieces, size)
        await reader.readinto(tview)
        good = ok and TRAILER.unpack(trailer)[0] == cut.digest(header.checksum, pieces)
        bad = _checked(good, size, bad, not staged, notify)
    await _finish_recv(header, bad, staged)


def _largest_chunk(header: Header) -> int:
    return min(header.chunk_size, header.data_len)


def compressed_scratch(header: Header) -> int:
    """Bytes that receiving this frame's data section allocates besides its destination: for a
    compressed section, one scratch buffer for a chunk's wire bytes and one chunk's decoded output,
    each at most the largest chunk the frame can have; nothing for a plain one. A server counts
    this in its store's ``used`` while it receives."""
    return 2 * _largest_chunk(header) if header.data_len and header.flags & _COMPRESSED else 0


async def _decode_into(codec: int, payload: memoryview, pieces: list[memoryview], size: int) -> bool:
    if size >= DECODE_OFF_LOOP:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _decode_now, codec, payload, pieces, size)
    return _decode_now(codec, payload, pieces, size)


def _decode_now(codec: int, payload: memoryview, pieces: list[memoryview], size: int) -> bool:
    try:
        raw = memoryview(lossless.decompress(codec, payload, size))
    except CorruptFrame:
        return False
    pos = 0
    for piece in pieces:
        piece[:] = raw[pos : pos + piece.nbytes]
        pos += piece.nbytes
    return True


async def skip_data(reader: FrameReader, header: Header) -> None:
    """Read and drop a frame's data section (to stay in step after refusing a request)."""
    if not header.data_len:
        return
    if header.flags & _COMPRESSED:
        await _skip_compressed(reader, header)
        return
    scratch = memoryview(bytearray(min(header.wire_data_len, READ_BUFFER)))
    left = header.wire_data_len
    while left:
        take = min(left, scratch.nbytes)
        await reader.readinto(scratch[:take])
        left -= take


async def _skip_compressed(reader: FrameReader, header: Header) -> None:
    head = memoryview(bytearray(lossless.CHUNK_HEAD.size))
    scratch = memoryview(bytearray(min(header.chunk_size, READ_BUFFER) + TRAILER_BYTES))
    left = header.data_len
    for _ in range(chunk_count(header.data_len, header.chunk_size)):
        size = min(left, header.chunk_size)
        left -= size
        _, wire = await _chunk_head(reader, head, size)
        rest = wire + TRAILER_BYTES
        while rest:
            take = min(rest, scratch.nbytes)
            await reader.readinto(scratch[:take])
            rest -= take
