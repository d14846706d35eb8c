"""Hostile and broken input in the frame protocol's own bytes: corrupt, truncated, lying or over a
limit; refused, never stored, and the server goes on serving."""

from __future__ import annotations

import asyncio
import struct
import time

import torch

from tensorwire import AsyncClient, ClientOptions, errors
from tensorwire._aio import within
from tensorwire.testing.conformance.frames import (
    assert_alive_and_empty,
    compressed_put_frame,
    expect_error,
    put_frame,
    raw,
    read_reply,
    still_serves,
)
from tensorwire.testing.conformance.harness import Harness
from tensorwire.transport.base import ByteStream
from tensorwire.transport.frame_io import FrameReader, read_head, send_frame
from tensorwire.types import Limits, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import HEADER_BYTES, Flags, Header, Opcode, decode_header, encode_frame_head
from tensorwire.wire.tensors import byte_view


async def a_bad_part_refuses_the_whole_batch(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        ok = TensorMeta("p/ok", torch.uint8, (2,), 2)
        bad = TensorMeta("p/../escape", torch.uint8, (2,), 2)
        await stream.send([put_frame([ok], b"ab", rid=3, flags=Flags.MORE)])
        await stream.send([put_frame([bad], b"cd", rid=3, flags=Flags.MORE)])
        after = TensorMeta("p/after", torch.uint8, (5000,), 5000)  # a part after the refused one
        await stream.send([put_frame([after], bytes(5000), rid=3, flags=Flags.MORE)])
        await stream.send([put_frame([TensorMeta("p/last", torch.uint8, (1,), 1)], b"e", rid=3)])
        await expect_error(reader, errors.ErrorCode.INVALID_NAME)  # one answer, for the whole batch
        await stream.send([put_frame([ok], b"ab", rid=4)])  # the session goes on
        header, _ = await read_reply(reader)
        assert not header.is_error and header.request_id == 4
        async with h.client(srv) as c:
            assert [m.name for m in await c.list()] == ["p/ok"]


async def an_unfinished_batch_stores_nothing(h: Harness) -> None:
    async with h.server(capacity=1 << 20) as srv:
        async with raw(srv) as (stream, reader):
            part = TensorMeta("u/a", torch.uint8, (600_000,), 600_000)
            await stream.send([put_frame([part], bytes(600_000), rid=5, flags=Flags.MORE)])
            # another request in the middle of the batch: refused, and the connection is dropped
            await stream.send([put_frame([TensorMeta("u/b", torch.uint8, (1,), 1)], b"x", rid=6)])
            await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)
            assert not await within(reader.at_frame_start(), 5), "session stayed open"
        async with raw(srv) as (stream, reader):  # any other request in the middle: the same
            await stream.send([put_frame([part], bytes(600_000), rid=5, flags=Flags.MORE)])
            ping = Header(1, Opcode.PING, 0, ChecksumKind.XXH3_64, 9, 0, 4096, 0)
            await stream.send([encode_frame_head(ping, b"")])
            await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)
            assert not await within(reader.at_frame_start(), 5), "session stayed open"
        async with raw(srv) as (stream, reader):  # an unknown opcode in the middle: the same
            await stream.send([put_frame([part], bytes(600_000), rid=5, flags=Flags.MORE)])
            odd = Header(1, 77, 0, ChecksumKind.XXH3_64, 6, 0, 4096, 0)
            await stream.send([encode_frame_head(odd, b"")])
            await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)
            assert not await within(reader.at_frame_start(), 5), "session stayed open"
        async with raw(srv) as (stream, reader):  # MORE on anything but PUT_MANY is refused
            more_ping = Header(1, Opcode.PING, Flags.MORE, ChecksumKind.XXH3_64, 11, 0, 4096, 0)
            await stream.send([encode_frame_head(more_ping, b"")])
            await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)
        async with raw(srv) as (stream, _):  # a batch cut off by a closed connection
            await stream.send([put_frame([part], bytes(600_000), rid=5, flags=Flags.MORE)])
        async with h.client(srv) as c:
            await _until_stored(c, "u/full", torch.zeros(1000_000, dtype=torch.uint8))
            assert [m.name for m in await c.list()] == ["u/full"]  # both reservations were freed


async def a_get_naming_a_tensor_twice_is_refused(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        await stream.send([put_frame([TensorMeta("g/x", torch.uint8, (3,), 3)], b"abc", rid=1)])
        await read_reply(reader)
        names = wm.encode_names(["g/x"] * 1000)  # one small tensor, asked for 1000 times
        get = Header(1, Opcode.GET_MANY, 0, ChecksumKind.XXH3_64, 2, len(names), 4096, 0)
        await stream.send([encode_frame_head(get, names)])
        await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)


async def an_unauthenticated_peer_cannot_make_the_server_allocate(h: Harness) -> None:
    async with h.server(token="t0ken") as srv, raw(srv) as (stream, reader):
        # A header that announces an 8 MiB metadata block, then one byte: refused at once.
        hello = bytearray(encode_frame_head(Header(1, Opcode.HELLO, 0, 1, 1, 0, 4096, 0), b""))
        hello[16:20] = (8 << 20).to_bytes(4, "little")  # meta_len: 8 MiB promised, 1 byte sent
        await stream.send([hello, b"x"])
        await expect_error(reader, errors.ErrorCode.UNAUTHENTICATED)
        assert not await within(reader.at_frame_start(), 5), "session stayed open"


async def _until_stored(c: AsyncClient, name: str, tensor: torch.Tensor, timeout: float = 5.0) -> None:
    """Put until the server has room: a dead connection's reservation is freed when the server
    notices the connection is gone, which may take a moment after the client closed it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await c.put(name, tensor)
            return
        except errors.CapacityExceeded:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


async def corrupt_chunk_is_never_stored(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        data = bytes(range(256)) * 40
        frame = put_frame([TensorMeta("victim", torch.uint8, (len(data),), len(data))], data)
        frame[-100] ^= 0x40  # a flipped bit in the last chunk
        await stream.send([frame])
        await expect_error(reader, errors.ErrorCode.CORRUPT_FRAME)
        await still_serves(stream, reader)
        async with h.client(srv) as c:
            assert [m.name for m in await c.list()] == ["ok"]


async def corrupt_compressed_chunk_is_never_stored(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        data = bytes(8192) + bytes(range(256)) * 16
        victim = [TensorMeta("victim", torch.uint8, (len(data),), len(data))]
        await stream.send([compressed_put_frame(victim, data, rid=5)])
        header, _ = await read_reply(reader)  # a well-formed compressed put is stored
        assert not header.is_error and header.request_id == 5
        frame = compressed_put_frame([TensorMeta("bad", torch.uint8, (len(data),), len(data))], data)
        frame[-12] ^= 0x40  # a flipped bit in the last chunk's compressed bytes
        await stream.send([frame])
        await expect_error(reader, errors.ErrorCode.CORRUPT_FRAME)
        await still_serves(stream, reader)
        async with h.client(srv) as c:
            assert [m.name for m in await c.list()] == ["ok", "victim"]
            assert bytes(byte_view(await c.get("victim"))) == data


async def a_lying_chunk_head_ends_the_session(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        data = bytes(4096)
        frame = compressed_put_frame([TensorMeta("x", torch.uint8, (4096,), 4096)], data)
        head = HEADER_BYTES + len(wm.encode_records([TensorMeta("x", torch.uint8, (4096,), 4096)]))
        frame[head + 1 : head + 5] = struct.pack("<I", 1 << 30)  # announces a GiB for a 4 KiB chunk
        await stream.send([frame])
        assert not await within(reader.at_frame_start(), 5), "session stayed open"
        await assert_alive_and_empty(srv, h)


async def a_partial_striped_put_is_never_visible(h: Harness) -> None:
    """PUT_RANGE writes land in an upload; only a PUT_COMMIT of ranges that tile the tensor makes
    it visible, and a commit with a range missing is refused."""
    async with h.server() as srv, raw(srv) as (stream, reader), h.client(srv) as c:
        data = bytes(range(256)) * 64  # 16 KiB, as two ranges of 8 KiB
        meta = TensorMeta("striped", torch.uint8, (len(data),), len(data))

        async def request(opcode: int, block: bytes, payload: bytes = b"", rid: int = 1) -> Header:
            header = Header(1, opcode, 0, ChecksumKind.XXH3_64, rid, len(block), 4096, len(payload))
            await send_frame(stream, header, block, [payload] if payload else [])
            return (await read_reply(reader))[0]

        assert not (await request(Opcode.PUT_RANGE, wm.encode_resumable(9, 0, meta), data[:8192])).is_error
        try:
            await c.stat("striped")
        except errors.KeyNotFound:
            pass
        else:
            raise AssertionError("half a striped put is visible")
        assert (await request(Opcode.PUT_COMMIT, wm.encode_resumable(9, 0, meta), rid=2)).is_error
        assert not (
            await request(Opcode.PUT_RANGE, wm.encode_resumable(9, 8192, meta), data[8192:], 3)
        ).is_error
        assert not (await request(Opcode.PUT_COMMIT, wm.encode_resumable(9, 0, meta), rid=4)).is_error
        assert bytes(byte_view(await c.get("striped"))) == data
        stale = wm.encode_get_range(99, 0, 10, "striped")
        header = await request(Opcode.GET_RANGE, stale, rid=5)
        assert header.is_error  # a range of a version that is gone: VERSION_CHANGED


async def bad_magic_and_version_end_the_session(h: Harness) -> None:
    async with h.server() as srv:
        for offset, value, code in (
            (0, ord("X"), errors.ErrorCode.PROTOCOL_ERROR),
            (4, 99, errors.ErrorCode.UNSUPPORTED_VERSION),
        ):
            async with raw(srv) as (stream, reader):
                frame = put_frame([TensorMeta("x", torch.uint8, (1,), 1)], b"z")
                frame[offset] = value
                await stream.send([frame])
                await expect_error(reader, code)
                assert not await within(reader.at_frame_start(), 5), "session stayed open"
        await assert_alive_and_empty(srv, h)


async def damaged_header_is_caught(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        frame = put_frame([TensorMeta("x", torch.uint8, (4,), 4)], b"abcd")
        frame[24] ^= 0x01  # data_len off by one: the header CRC must catch it before it is trusted
        await stream.send([frame])
        await expect_error(reader, errors.ErrorCode.CORRUPT_FRAME)
        await assert_alive_and_empty(srv, h)


async def truncated_frame_stores_nothing(h: Harness) -> None:
    async with h.server() as srv:
        async with raw(srv) as (stream, _):
            data = bytes(100_000)
            frame = put_frame([TensorMeta("half", torch.uint8, (len(data),), len(data))], data)
            await stream.send([frame[: len(frame) // 2]])
        await assert_alive_and_empty(srv, h)


async def limits_are_enforced(h: Harness) -> None:
    limits = Limits(max_meta_bytes=4096, max_ndim=4, max_request_bytes=1 << 20)
    async with h.server(limits=limits) as srv:
        async with raw(srv) as (stream, reader):  # too many dims: refused, session goes on
            meta = TensorMeta("d", torch.uint8, (1, 1, 1, 1, 1), 1)
            await stream.send([put_frame([meta], b"x")])
            await expect_error(reader, errors.ErrorCode.LIMIT_EXCEEDED)
            await stream.send([put_frame([TensorMeta("e", torch.uint8, (1,), 1)], b"y", rid=9)])
            header, _ = await read_reply(reader)
            assert not header.is_error
        for field, value in ((16, 1 << 20), (24, 1 << 40)):  # meta_len / data_len over the limit
            async with raw(srv) as (stream, reader):
                frame = bytearray(put_frame([TensorMeta("x", torch.uint8, (1,), 1)], b"z"))
                width = 4 if field == 16 else 8
                frame[field : field + width] = value.to_bytes(width, "little")
                await stream.send([frame[:40]])
                await expect_error(reader, errors.ErrorCode.LIMIT_EXCEEDED)


async def lying_records_are_refused(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        # shape says 8 bytes, nbytes says 4: refused, and nothing is stored
        lie = wm.encode_records([TensorMeta("l", torch.uint8, (4,), 4)])
        lie = lie[:-16] + struct.pack("<QQ", 8, 0)
        header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, 3, len(lie), 4096, 8)
        body = bytes(8) + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, bytes(8)))
        await stream.send([encode_frame_head(header, lie) + body])
        await expect_error(reader, errors.ErrorCode.INVALID_TENSOR)
        # an unknown dtype code
        rec = bytearray(wm.encode_records([TensorMeta("u", torch.uint8, (1,), 1)]))
        rec[4 + 2 + 1] = 250
        header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, 4, len(rec), 4096, 1)
        body = b"q" + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, b"q"))
        await stream.send([encode_frame_head(header, bytes(rec)) + body])
        await expect_error(reader, errors.ErrorCode.INVALID_TENSOR)
        # a name that escapes
        await stream.send([put_frame([TensorMeta("../../etc/passwd", torch.uint8, (1,), 1)], b"x", rid=5)])
        await expect_error(reader, errors.ErrorCode.INVALID_NAME)
        await assert_alive_and_empty(srv, h)


async def corrupt_get_response_is_retried(h: Harness) -> None:
    """A peer that damages its first GET answer: the client must not return it, and must retry."""
    payload = torch.arange(1000, dtype=torch.int32)
    answers = 0

    async def flaky(stream: ByteStream) -> None:
        nonlocal answers
        reader = FrameReader(stream)
        while await reader.at_frame_start():
            raw_head = await read_head(reader)
            req = decode_header(raw_head, Limits())
            await reader.read(req.meta_len)
            if req.opcode == Opcode.HELLO:
                info = wm.ServerInfo(1, Limits(), 1 << 30, 0)
                meta = wm.encode_hello_response(info)
                data: list[memoryview] = []
            else:
                answers += 1
                meta = wm.encode_records([TensorMeta.of("p", payload).with_version(1)])
                data = [byte_view(payload.clone())]
                if answers == 1:
                    data[0][10] ^= 0xFF  # the checksum is computed after: damage "in transit"
            header = Header(1, req.opcode, Flags.RESPONSE, req.checksum, req.request_id, len(meta), 4096,
                            sum(d.nbytes for d in data))  # fmt: skip
            if data and answers == 1:
                await _send_damaged(stream, header, meta, data[0], payload)
            else:
                await send_frame(stream, header, meta, data)

    async with h.peer(flaky) as url:
        client = AsyncClient(url, ClientOptions(timeout=5, retries=2, backoff=0.01))
        try:
            got = await client.get("p")
        finally:
            await client.close()
    assert answers == 2 and torch.equal(got, payload)


async def _send_damaged(
    stream: ByteStream, header: Header, meta: bytes, damaged: memoryview, good: torch.Tensor
) -> None:
    """Send ``damaged`` bytes with the trailers of ``good``: a corruption the checksums must catch."""
    good_view = byte_view(good)
    out = bytearray(encode_frame_head(header, meta))
    for i in range(0, header.data_len, header.chunk_size):
        out += damaged[i : i + header.chunk_size]
        out += struct.pack("<Q", checksum(header.checksum, good_view[i : i + header.chunk_size]))
    await stream.send([out])
