"""Generations: every piece of state a peer makes the server hold is bounded and counted (issue 17).

Parked GEN_WAITs per connection and server-wide, leases per connection, prefixes with
generations; waits and leases end with their connection; a publish cut off mid-stream leaves
nothing behind. Each test was checked to fail with its bound removed from the server.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Iterator

import pytest
import torch

import tensorwire
import tensorwire._aio
from tensorwire.errors import LimitExceeded
from tensorwire.server.options import ServerOptions
from tensorwire.store.generations import GenerationConfig
from tensorwire.testing.process import wait_for
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import Flags, Header, Opcode, encode_frame_head


def serve(**config: float) -> tensorwire.ServerThread:
    return tensorwire.ServerThread(options=ServerOptions(generations=GenerationConfig(**config)))  # type: ignore[arg-type]


@pytest.fixture
def small() -> Iterator[tensorwire.ServerThread]:
    with serve(waiters_per_owner=4, max_waiters=6, leases_per_owner=3, max_prefixes=3, keep=10) as srv:
        yield srv


async def _waits(url: str, count: int, prefix: str = "w") -> tuple[list[asyncio.Future[object]], object]:
    client = await tensorwire.aconnect(url)
    waits = [asyncio.ensure_future(client.wait(prefix, 0, timeout=20)) for _ in range(count)]
    await asyncio.sleep(0)  # sent, in order
    return waits, client


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """``wait_for`` on an event loop: poll without blocking it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"waited {timeout}s for {what}")
        await asyncio.sleep(0.01)


def test_parked_waits_are_bounded_per_connection_and_per_server(small: tensorwire.ServerThread) -> None:
    async def main() -> None:
        first, a = await _waits(small.url, 5)  # one more than a connection may park
        refused = await asyncio.wait_for(asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED), 10)
        assert [type(f.exception()) for f in refused[0]] == [LimitExceeded]
        second, b = await _waits(small.url, 4)  # the server holds 6: two of these are refused
        await until(lambda: sum(1 for f in second if f.done()) == 2, "two refusals")
        assert all(isinstance(f.exception(), LimitExceeded) for f in second if f.done())
        async with await tensorwire.aconnect(small.url) as pub:
            gen = await pub.publish("w", {"x": torch.zeros(1)})
        woken = [f for f in first + second if not f.done() or f.exception() is None]
        assert len(woken) == 6 and all(r == gen for r in await asyncio.gather(*woken))
        for client in (a, b):
            await client.close()  # type: ignore[attr-defined]

    tensorwire._aio.run(main())
    # A wait is uncounted when its server task ends, which may be just after its answer reached us.
    wait_for(lambda: small.server.generation_ops.waiting == 0, 10, "the answered waits to be uncounted")


def test_waits_end_with_their_connection(small: tensorwire.ServerThread) -> None:
    async def main() -> None:
        waits, client = await _waits(small.url, 4, "gone")
        ops = small.server.generation_ops
        await until(lambda: ops.waiting == 4, "four parked waits")
        await client.close()  # type: ignore[attr-defined]
        await asyncio.gather(*waits, return_exceptions=True)

    tensorwire._aio.run(main())
    wait_for(lambda: small.server.generation_ops.waiting == 0, 10, "the waits to end with the connection")


def test_leases_are_bounded_per_connection(small: tensorwire.ServerThread) -> None:
    with tensorwire.connect(small.url) as c, tensorwire.connect(small.url) as other:
        for g in range(1, 6):
            c.publish("l", {"x": torch.full((1,), float(g))})
        leases = [c.lease("l", g, 30) for g in (1, 2, 3)]
        with pytest.raises(LimitExceeded, match="3 leases"):
            c.lease("l", 4, 30)
        leases[0].renew(30)  # a renewal is not a new lease
        leases[0].release()
        c.lease("l", 4, 30)  # room again
        other.lease("l", 5, 30)  # the bound is per connection


def test_prefixes_are_bounded_and_a_refusal_reserves_nothing(small: tensorwire.ServerThread) -> None:
    store = small.server.store
    with tensorwire.connect(small.url) as c:
        for prefix in ("p1", "p2", "p3"):
            c.publish(prefix, {"x": torch.zeros(1)})
        used = store.used
        with pytest.raises(LimitExceeded, match="at most 3"):
            c.publish("p4", {"x": torch.zeros(1 << 20)})
        assert store.used == used and len(small.server.generations) == 3


def test_a_publish_cut_off_mid_stream_leaves_the_previous_generation(small: tensorwire.ServerThread) -> None:
    store = small.server.store
    with tensorwire.connect(small.url) as c:
        first = c.publish("cut", {"x": torch.ones(4)})
        used = store.used
        meta = TensorMeta("cut/x", torch.uint8, (1 << 16,), 1 << 16)
        block = wg.encode_prefix("cut") + wm.encode_records([meta])
        chunk = 4096
        kind = ChecksumKind.XXH3_64
        header = Header(1, Opcode.GEN_PUBLISH, Flags.MORE, kind, 9, len(block), chunk, meta.nbytes)
        piece = bytes(chunk)
        address = Address.parse(small.url)
        with socket.create_connection((address.host, address.port), timeout=10) as sock:
            sock.sendall(encode_frame_head(header, block))
            sock.sendall(piece + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, piece)))  # 1 of 16 chunks
            wait_for(lambda: store.used > used, 10, "the server to reserve the cut publish")
        wait_for(lambda: store.used == used, 10, "the cut publish to be dropped")
        assert c.manifest("cut").generation == first
        assert c.publish("cut", {"x": torch.zeros(4)}).number == 2
