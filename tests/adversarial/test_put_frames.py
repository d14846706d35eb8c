"""A PUT carries one tensor in one frame, and the server serves it on a path of its own
(``StoreOps.put_one``, without a batch's state across frames). A PUT frame that says it carries
more is refused before any of its records becomes an object, nothing of it is stored, and the
connection stays in step for the next request."""

from __future__ import annotations

import struct
import tracemalloc

import torch

from tensorwire._aio import run
from tensorwire.errors import ErrorCode
from tensorwire.server import Server
from tensorwire.store import TensorStore
from tensorwire.testing.conformance import raw, read_reply, still_serves
from tensorwire.types import GiB, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import Header, Opcode, encode_frame_head


def _put(block: bytes, data: bytes, rid: int) -> bytes:
    """A PUT frame built by hand: ``block`` is its records block, ``data`` one chunk."""
    header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, rid, len(block), 4096, len(data))
    trailer = struct.pack("<Q", checksum(ChecksumKind.XXH3_64, data)) if data else b""
    return encode_frame_head(header, block) + data + trailer


async def _refusals(frames: list[bytes]) -> tuple[list[int], int, int]:
    """The error code of each frame's answer on one connection, then whether that connection
    still stores a small put; the peak of Python allocations meanwhile; the tensors stored."""
    srv = Server(store=TensorStore(4 * GiB))
    await srv.start("tcp://127.0.0.1:0")
    try:
        async with raw(srv) as (stream, reader):
            codes = []
            tracemalloc.start()
            try:
                for frame in frames:
                    await stream.send([frame])
                    header, meta = await read_reply(reader)
                    codes.append(wm.decode_error(meta)[0] if header.is_error else 0)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            await still_serves(stream, reader)
        return codes, peak, len(srv.store)
    finally:
        await srv.close()


def test_a_put_that_names_many_tensors_is_refused_before_they_are_decoded() -> None:
    """100,000 records (3 MB of metadata) in one PUT, to a store with room for all their names:
    refused at its count, before the records become 100,000 Python objects (~30 MB). It used to
    decode them all (on a worker thread) to find that a PUT carries one."""
    record = wm.encode_records([TensorMeta("m/0", torch.uint8, (0,), 0)])[4:]
    block = struct.pack("<I", 100_000) + record * 100_000
    size = len(block)
    codes, peak, stored = run(_refusals([_put(block, b"", 3)]))
    assert codes == [ErrorCode.PROTOCOL_ERROR]
    assert peak < 4 * size, f"{peak} bytes allocated for a {size}-byte refusal"
    assert stored == 1  # only still_serves's put


def test_a_put_of_two_tensors_or_of_the_wrong_size_is_refused_and_stores_nothing() -> None:
    two = wm.encode_records(
        [TensorMeta("t/a", torch.uint8, (2,), 2), TensorMeta("t/b", torch.uint8, (2,), 2)]
    )
    short = wm.encode_records([TensorMeta("t/c", torch.uint8, (4,), 4)])
    codes, _, stored = run(_refusals([_put(two, b"abcd", 4), _put(short, b"abcdefgh", 5)]))
    assert codes == [ErrorCode.PROTOCOL_ERROR, ErrorCode.INVALID_TENSOR]
    assert stored == 1
