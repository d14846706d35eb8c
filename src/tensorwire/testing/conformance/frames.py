"""Hand-made frames on a raw connection to a server: for the cases that speak the frame protocol
themselves (corrupt, truncated, over a limit) and for tests outside the suite that need the same."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator

import torch

from tensorwire import Server, errors, transport
from tensorwire._aio import within
from tensorwire.testing.conformance.harness import Harness
from tensorwire.transport.base import ByteStream
from tensorwire.transport.frame_io import FrameReader, read_head
from tensorwire.types import Limits, TensorMeta
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import Flags, Header, Opcode, decode_header, encode_frame_head


@contextlib.asynccontextmanager
async def raw(srv: Server) -> AsyncIterator[tuple[ByteStream, FrameReader]]:
    stream = await transport.connect_stream(srv.addresses[0], 5.0)
    try:
        yield stream, FrameReader(stream)
    finally:
        await stream.close()


async def read_reply(reader: FrameReader) -> tuple[Header, wm.MetaReader]:
    raw_head = await within(read_head(reader), 5)
    header = decode_header(raw_head, Limits(max_meta_bytes=1 << 30))
    meta = await reader.read(header.meta_len)
    return header, wm.MetaReader(meta, Limits())


async def expect_error(reader: FrameReader, code: errors.ErrorCode) -> None:
    header, meta = await read_reply(reader)
    assert header.is_error, "expected an ERROR frame"
    got, message = wm.decode_error(meta)
    assert got == code, f"expected {code.name}, got {errors.ErrorCode(got).name}: {message}"


def put_frame(
    meta_list: list[TensorMeta], data: bytes, rid: int = 7, chunk: int = 4096, flags: int = 0
) -> bytearray:
    """A PUT_MANY frame built by hand: header, records, data chunks and their xxh3 trailers."""
    meta = wm.encode_records(meta_list)
    header = Header(1, Opcode.PUT_MANY, flags, ChecksumKind.XXH3_64, rid, len(meta), chunk, len(data))
    out = bytearray(encode_frame_head(header, meta))
    for i in range(0, len(data), chunk):
        piece = data[i : i + chunk]
        out += piece + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, piece))
    return out


def compressed_put_frame(
    meta_list: list[TensorMeta], data: bytes, rid: int = 7, chunk: int = 4096
) -> bytearray:
    """A PUT_MANY frame with flag COMPRESSED: each chunk lz4-compressed behind its chunk head."""
    meta = wm.encode_records(meta_list)
    header = Header(
        1, Opcode.PUT_MANY, Flags.COMPRESSED, ChecksumKind.XXH3_64, rid, len(meta), chunk, len(data)
    )
    out = bytearray(encode_frame_head(header, meta))
    for i in range(0, len(data), chunk):
        piece = data[i : i + chunk]
        payload = lossless.compress(lossless.Codec.LZ4, piece)
        out += lossless.CHUNK_HEAD.pack(lossless.Codec.LZ4, len(payload)) + payload
        out += struct.pack("<Q", checksum(ChecksumKind.XXH3_64, piece))
    return out


async def assert_alive_and_empty(srv: Server, h: Harness) -> None:
    """The server still answers a new client, and nothing was stored."""
    async with h.client(srv) as c:
        await c.ping()
        assert await c.list() == []


async def still_serves(stream: ByteStream, reader: FrameReader) -> None:
    """The same connection keeps working after an error: a small put on it is stored."""
    await stream.send([put_frame([TensorMeta("ok", torch.uint8, (3,), 3)], b"abc", rid=8)])
    header, _ = await read_reply(reader)
    assert not header.is_error and header.request_id == 8
