"""Item 7: the scratch a compressed put costs is sized by the data it declares, and counted.

A 4 KiB compressed put that declares the largest chunk size, then stalls before its trailer, made
the server allocate a 64 MiB scratch buffer per connection. A zstd chunk whose frame claims more
bytes than its chunk made the library allocate what the frame claimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import tracemalloc
from collections.abc import AsyncIterator, Iterator

import torch
import zstandard

from tensorwire import errors
from tensorwire._aio import run
from tensorwire.server import Server
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.testing.conformance import raw, read_reply
from tensorwire.types import KiB, Limits, MiB, TensorMeta
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import Flags, Header, Opcode, encode_frame_head

DATA = bytes(range(256)) * 16  # 4 KiB, compressible
STALLED = 4


def compressed_put(name: str, data: bytes, chunk: int, codec: int, payload: bytes) -> bytes:
    """A one-chunk compressed PUT of ``data`` whose chunk travels as ``payload``."""
    block = wm.encode_records([TensorMeta(name, torch.uint8, (len(data),), len(data))])
    header = Header(1, Opcode.PUT, Flags.COMPRESSED, ChecksumKind.XXH3_64, 1, len(block), chunk, len(data))
    head = lossless.CHUNK_HEAD.pack(codec, len(payload))
    trailer = struct.pack("<Q", checksum(ChecksumKind.XXH3_64, data))
    return encode_frame_head(header, block) + head + payload + trailer


@contextlib.asynccontextmanager
async def server(capacity: int) -> AsyncIterator[Server]:
    srv = Server(ServerOptions(limits=Limits()), store=TensorStore(capacity))
    await srv.start("tcp://127.0.0.1:0")
    try:
        yield srv
    finally:
        await srv.close()


@contextlib.contextmanager
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


async def received(srv: Server, nbytes: int) -> None:
    """Wait until the server's sessions have read ``nbytes`` in all (they are then waiting)."""
    for _ in range(500):
        if sum(s.reader.received for s in list(srv._sessions)) >= nbytes:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the server did not read the {nbytes} bytes sent within 5 s")


async def stalled_compressed_puts() -> None:
    payload = lossless.compress(lossless.Codec.LZ4, DATA)
    largest = Limits().max_chunk_bytes  # what the frames declare: 64 MiB chunks
    async with server(1 * MiB) as srv, contextlib.AsyncExitStack() as stack:
        streams = [await stack.enter_async_context(raw(srv)) for _ in range(STALLED)]
        with traced():
            before = tracemalloc.get_traced_memory()[0]
            sent = 0
            for i, (stream, _) in enumerate(streams):
                frame = compressed_put(f"s/{i}", DATA, largest, lossless.Codec.LZ4, payload)
                await stream.send([frame[:-8]])  # all but the trailer: the server holds its scratch
                sent += len(frame) - 8
            await received(srv, sent)
            grown = tracemalloc.get_traced_memory()[0] - before
        assert grown < 2 * MiB, f"{STALLED} stalled 4 KiB puts took {grown / MiB:.0f} MiB of scratch"
        assert srv.store.scratch_bytes == STALLED * 2 * len(DATA), "the scratch is counted in used"
        assert srv.store.used >= STALLED * 3 * len(DATA)
        for i, (stream, reader) in enumerate(streams):  # they finish, and the scratch is given back
            await stream.send([struct.pack("<Q", checksum(ChecksumKind.XXH3_64, DATA))])
            header, _ = await read_reply(reader)
            assert not header.is_error, f"put {i} failed"
        assert srv.store.scratch_bytes == 0


async def a_zstd_frame_claiming_more_than_its_chunk() -> None:
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(256 * MiB))
    chunk = 64 * KiB
    data = bytes(chunk)
    assert len(bomb) < chunk  # a valid chunk head: fewer wire bytes than the chunk stands for
    async with server(1 * MiB) as srv, raw(srv) as (stream, reader):
        with traced():
            await stream.send([compressed_put("bomb", data, chunk, lossless.Codec.ZSTD, bomb)])
            header, meta = await read_reply(reader)
            peak = tracemalloc.get_traced_memory()[1]
        assert header.is_error and wm.decode_error(meta)[0] == errors.ErrorCode.CORRUPT_FRAME
        assert peak < 16 * MiB, f"a {len(bomb)}-byte zstd chunk made the server allocate {peak / MiB:.0f} MiB"


def test_stalled_compressed_puts_hold_scratch_sized_by_their_data() -> None:
    run(stalled_compressed_puts())


def test_a_zstd_chunk_is_never_decoded_past_its_declared_size() -> None:
    run(a_zstd_frame_claiming_more_than_its_chunk())
