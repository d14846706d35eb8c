"""Item 2: a striped put never publishes bytes that failed their checksum.

Two real connections write into one striped upload (PUT_RANGE), one of them with a damaged chunk;
whatever the order, PUT_COMMIT publishes only bytes whose chunks were verified where they lie. A
range has one writer at a time: a second writer of the same bytes waits for the first to let go.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

import torch

from tensorwire import errors
from tensorwire._aio import run
from tensorwire.server import Server
from tensorwire.store import TensorStore
from tensorwire.testing.conformance import raw, read_reply
from tensorwire.transport.base import ByteStream
from tensorwire.transport.frame_io import FrameReader
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import Header, Opcode, encode_frame_head

CHUNK = 4096
SIZE = 4 * CHUNK
GOOD = bytes(range(256)) * (SIZE // 256)
BAD = b"\xee" * SIZE
META = TensorMeta("striped", torch.uint8, (SIZE,), SIZE)
UPLOAD = 9


def range_frame(offset: int, data: bytes, rid: int, damaged: bool = False) -> bytes:
    """A PUT_RANGE of ``data`` at ``offset``, with a wrong checksum on its first chunk if ``damaged``."""
    block = wm.encode_resumable(UPLOAD, offset, META)
    header = Header(1, Opcode.PUT_RANGE, 0, ChecksumKind.XXH3_64, rid, len(block), CHUNK, len(data))
    out = bytearray(encode_frame_head(header, block))
    for i in range(0, len(data), CHUNK):
        piece = data[i : i + CHUNK]
        digest = checksum(ChecksumKind.XXH3_64, piece) ^ (1 if damaged and i == 0 else 0)
        out += piece + struct.pack("<Q", digest)
    return bytes(out)


async def request(stream: ByteStream, reader: FrameReader, frame: bytes) -> int:
    """Send a frame, return the error code of its answer (0: it succeeded)."""
    await stream.send([frame])
    header, meta = await read_reply(reader)
    return wm.decode_error(meta)[0] if header.is_error else 0


async def commit(stream: ByteStream, reader: FrameReader, rid: int) -> int:
    block = wm.encode_resumable(UPLOAD, 0, META)
    header = Header(1, Opcode.PUT_COMMIT, 0, ChecksumKind.XXH3_64, rid, len(block), CHUNK, 0)
    return await request(stream, reader, encode_frame_head(header, block))


def stored(srv: Server) -> bytes | None:
    """The published bytes of the striped tensor, or None if it was never published."""
    try:
        (entry,) = srv.store.acquire([META.name])
    except errors.KeyNotFound:
        return None
    try:
        return bytes(entry.data)
    finally:
        srv.store.release([entry])


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"waited 5 s for {what}")


def writing(srv: Server) -> bool:
    """Whether a write into the striped upload is under way (its range claimed, not yet done)."""
    return any(u.writing for u in list(srv.uploads._open.values()))


def waiting_or_answered(srv: Server) -> bool:
    """Whether B's write waits for A's to let go of the range, or (a server that lets two writers
    in at once) was already answered."""
    waiting = any(getattr(u, "on_release", None) for u in list(srv.uploads._open.values()))
    answered = any(row.errors for (op, _), row in srv.counts.rows.items() if op == "put_range")
    return waiting or answered


async def two_writers_of_one_range() -> None:
    """A writes the range and holds back its last chunk; B writes the same range, damaged; A sends
    its last chunk, so every chunk of A's verified when it landed. B's bytes, wherever they went,
    failed their checksum: the commit must not publish them."""
    srv = Server(store=TensorStore(1 << 30))
    await srv.start("tcp://127.0.0.1:0")
    try:
        async with raw(srv) as (a, a_reader), raw(srv) as (b, b_reader):
            good = range_frame(0, GOOD, rid=1)
            last = CHUNK + 8  # the last chunk and its checksum
            await a.send([good[:-last]])  # A is mid-write, its first chunks verified
            await until(lambda: writing(srv), "A's write to be under way")  # before B's comes in
            await b.send([range_frame(0, BAD, rid=2, damaged=True)])
            await until(lambda: waiting_or_answered(srv), "B's write to wait for A's, or be answered")
            await a.send([good[-last:]])
            header, _ = await read_reply(a_reader)
            assert not header.is_error, "A's own write was verified"
            header, meta = await read_reply(b_reader)  # B went after A: its damaged bytes are there
            assert header.is_error and wm.decode_error(meta)[0] == errors.ErrorCode.CORRUPT_FRAME
            assert await commit(a, a_reader, rid=3) == errors.ErrorCode.PROTOCOL_ERROR
            assert stored(srv) is None, "the commit published bytes that failed their checksum"
            assert await request(a, a_reader, range_frame(0, GOOD, rid=4)) == 0  # written again
            assert await commit(a, a_reader, rid=5) == 0
            assert stored(srv) == GOOD
    finally:
        await srv.close()


async def a_damaged_overlap_drops_the_verified_note() -> None:
    """A writes [0, 2 chunks) and [2, 4 chunks), both verified; B rewrites [1, 3 chunks) damaged.
    The bytes B left are unverified wherever they lie: the commit is refused until they are
    written again, and then it publishes the good bytes."""
    srv = Server(store=TensorStore(1 << 30))
    await srv.start("tcp://127.0.0.1:0")
    try:
        async with raw(srv) as (a, a_reader), raw(srv) as (b, b_reader):
            half = 2 * CHUNK
            assert await request(a, a_reader, range_frame(0, GOOD[:half], rid=1)) == 0
            assert await request(a, a_reader, range_frame(half, GOOD[half:], rid=2)) == 0
            overlap = range_frame(CHUNK, BAD[: 2 * CHUNK], rid=3, damaged=True)
            assert await request(b, b_reader, overlap) == errors.ErrorCode.CORRUPT_FRAME
            assert await commit(a, a_reader, rid=4) == errors.ErrorCode.PROTOCOL_ERROR
            assert stored(srv) is None, "the commit published bytes that failed their checksum"
            assert await request(a, a_reader, range_frame(0, GOOD[:half], rid=5)) == 0
            assert await request(a, a_reader, range_frame(half, GOOD[half:], rid=6)) == 0
            assert await commit(a, a_reader, rid=7) == 0
            assert stored(srv) == GOOD
    finally:
        await srv.close()


def test_a_second_writer_of_a_range_waits_and_its_damaged_bytes_are_never_published() -> None:
    run(two_writers_of_one_range())


def test_a_damaged_write_over_verified_ranges_blocks_the_commit_until_rewritten() -> None:
    run(a_damaged_overlap_drops_the_verified_note())


async def tiny_ranges() -> None:
    srv = Server(store=TensorStore(1 << 30))
    await srv.start("tcp://127.0.0.1:0")
    try:
        async with raw(srv) as (a, a_reader):
            tiny = range_frame(0, GOOD[:1], rid=1)
            assert await request(a, a_reader, tiny) == errors.ErrorCode.PROTOCOL_ERROR
            last = range_frame(SIZE - 1, GOOD[-1:], rid=2)  # the last range may be short
            assert await request(a, a_reader, last) == 0
            assert [len(u.ranges) for u in srv.uploads._open.values()] == [1]
    finally:
        await srv.close()


def test_a_range_is_never_tiny_but_the_last() -> None:
    """Sweep (tables a peer can grow): each verified range is a note the server keeps; 1-byte
    ranges would grow the table by ~100 bytes per byte reserved."""
    run(tiny_ranges())
