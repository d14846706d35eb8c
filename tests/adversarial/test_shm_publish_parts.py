"""SHM_GEN_PART (docs/protocol.md §12.2, §14.8): a part of a multi-part publish whose bytes an
SHM_PUT's segments hold. A part counts only with a put its own connection holds open (not another
connection's, not one released already), and only if the bytes in the segments have the chunk
checksums the request gives; every refusal frees what the put reserved. Each test fails with its
check removed from server/shm.py (``session.puts``) or server/generation_parts.py (``expected``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire import transport
from tensorwire.errors import ProtocolError, PublishAborted
from tensorwire.server import ServerThread
from tensorwire.testing.process import wait_for
from tensorwire.transport import TransportOptions
from tensorwire.transport.shm import ShmTransport
from tensorwire.types import MiB, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire import shm as ws
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view

OPTIONS = TransportOptions(5.0, 5.0)
BIG = torch.arange(MiB // 4, dtype=torch.float32)  # 1 MiB: in a segment


@pytest.fixture
def srv() -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0", "shm://127.0.0.1:0"]) as server:
        yield server


async def _open(srv: ServerThread) -> ShmTransport:
    url = next(a for a in srv.addresses if a.scheme == "shm")
    opened = await transport.open_transport(url, OPTIONS)
    assert isinstance(opened, ShmTransport)
    return opened


async def _reserve(t: ShmTransport, name: str) -> tuple[int, list[ws.SegmentRef], TensorMeta]:
    meta = TensorMeta(name, torch.float32, tuple(BIG.shape), BIG.nbytes)
    reader = await t.call(Opcode.SHM_PUT, wm.encode_records([meta]), what="SHM_PUT")
    put_id = reader.u64()
    refs = ws.decode_refs(reader, 1)
    reader.done()
    return put_id, refs, meta


async def _commit_part(t: ShmTransport, put_id: int, sums: list[tuple[int, ...]], txn: bytes) -> None:
    head = wg.PartHead("p", txn, 0, 1, 5000)
    body = wg.encode_shm_part(head, put_id, sums) + wm.encode_records([])
    await t.call(Opcode.SHM_GEN_PART, body, what="SHM_GEN_PART", timeout=10)


def _idle(srv: ServerThread) -> None:
    store, parts = srv.server.store, srv.server.generation_ops.parts
    wait_for(lambda: not parts.open and store.used == 0, 10, "every reservation to be freed")


def test_a_part_through_segments_is_published_and_its_bytes_never_cross_the_socket(srv: ServerThread) -> None:
    url = str(next(a for a in srv.addresses if a.scheme == "shm"))

    async def main() -> tensorwire.Generation:
        async with await tensorwire.aconnect(url) as c:
            tensors = {"big": BIG, "small": torch.ones(3)}
            return await c.publish_part("p", tensors, txn=os.urandom(16), index=0, count=1, timeout=5)

    gen = asyncio.run(asyncio.wait_for(main(), 30))
    assert gen.names == ("p/big", "p/small")
    with tensorwire.connect(srv.url) as c:
        got = c.get_many(["p/big", "p/small"], at="latest", verify=True)
    assert torch.equal(got["p/big"], BIG) and torch.equal(got["p/small"], torch.ones(3))
    over_shm = sum(r.received for (_, t), r in srv.server.counts.rows.items() if t == "shm")
    assert over_shm < BIG.nbytes  # the small tensor and the control frames only


def test_a_part_naming_another_connections_put_is_refused(srv: ServerThread) -> None:
    async def main() -> None:
        a, b = await _open(srv), await _open(srv)
        try:
            put_id, _, _ = await _reserve(a, "p/w")
            with pytest.raises(ProtocolError, match="does not hold open"):
                await _commit_part(b, put_id, [wg.chunk_checksums(byte_view(BIG))], os.urandom(16))
            assert srv.server.store.reserved > 0  # a's put is still a's, open
        finally:
            await a.close()
            await b.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    _idle(srv)


def test_a_part_whose_put_was_released_is_refused(srv: ServerThread) -> None:
    async def main() -> None:
        t = await _open(srv)
        try:
            put_id, refs, _ = await _reserve(t, "p/w")
            segment = t.maps.get(refs[0].segment, writable=True)
            segment[ws.HEADER_BYTES : ws.HEADER_BYTES + BIG.nbytes] = byte_view(BIG)
            await t.call(Opcode.SHM_RELEASE, ws.encode_release([], [put_id]), what="SHM_RELEASE")
            with pytest.raises(ProtocolError, match="does not hold open"):
                await _commit_part(t, put_id, [wg.chunk_checksums(byte_view(BIG))], os.urandom(16))
        finally:
            await t.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    _idle(srv)
    assert srv.server.generations.latest("p") is None


def test_a_part_whose_segment_does_not_hold_its_checksums_is_refused(srv: ServerThread) -> None:
    async def main() -> None:
        t = await _open(srv)
        try:
            put_id, refs, _ = await _reserve(t, "p/w")
            segment = t.maps.get(refs[0].segment, writable=True)
            segment[ws.HEADER_BYTES : ws.HEADER_BYTES + BIG.nbytes] = byte_view(BIG)
            segment[ws.HEADER_BYTES + 100] ^= 0xFF  # written after the client took its checksums
            with pytest.raises(PublishAborted, match="does not hold the bytes its checksums say"):
                await _commit_part(t, put_id, [wg.chunk_checksums(byte_view(BIG))], os.urandom(16))
        finally:
            await t.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    _idle(srv)
    assert srv.server.generations.latest("p") is None


def test_a_part_with_too_few_checksums_is_refused(srv: ServerThread) -> None:
    async def main() -> None:
        t = await _open(srv)
        try:
            put_id, _, _ = await _reserve(t, "p/w")
            with pytest.raises(ProtocolError, match="truncated"):
                await _commit_part(t, put_id, [], os.urandom(16))
        finally:
            await t.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    _idle(srv)
