"""What a hostile or broken coordinator can do to the etcd coordinator, and what it must not.

- A leader key holding anything but what we write (not JSON, huge, wrong types, no lease): read as
  "no leader" with a warning, never taken over by a campaign, never an exception that is not
  tensorwire's.
- An endpoint that accepts TCP and never answers, or answers with bytes that are not HTTP/2:
  every call raises ``CoordinatorUnavailable`` within the coordinator's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import pytest

from tensorwire.coordinator import Term, open_coordinator
from tensorwire.coordinator.codec import leader_key
from tensorwire.coordinator.local import LocalEtcd
from tensorwire.errors import CoordinatorUnavailable

rpc = pytest.importorskip("aetcd.rpc", reason="the etcd extra (aetcd) is not installed")

T = TypeVar("T")
TIMEOUT = 0.5
MARGIN = 0.5
NO_ETCD = "etcd not on PATH (as root: apt-get install etcd-server)"
needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason=NO_ETCD)


def run(coro: Coroutine[Any, Any, T], limit: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, limit)

    return asyncio.run(bounded())


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    if shutil.which("etcd") is None:
        pytest.skip(NO_ETCD)
    with LocalEtcd() as server:
        yield server


GARBAGE = {
    "not-json": b"\xff\xfe not json at all",
    "huge": b'{"v":1,"member":"' + b"m" * (1024 * 1024) + b'","address":"tcp://a:1"}',
    "wrong-types": b'{"v":1,"member":7,"address":["tcp://a:1"]}',
    "extra-field": b'{"v":1,"member":"m","address":"tcp://a:1","epoch":99}',
    "other-version": b'{"v":2,"member":"m","address":"tcp://a:1"}',
    "bool-version": b'{"v":true,"member":"m","address":"tcp://a:1"}',
    "control-chars": b'{"v":1,"member":"m\\u001b[2J","address":"tcp://a:1"}',
    "deep-nesting": b"[" * 3000 + b"]" * 3000,
    "a-list": b'["m","tcp://a:1"]',
    "empty": b"",
}


async def raw_put(etcd: LocalEtcd, key: bytes, value: bytes, *, leased: bool) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        lease = 0
        if leased:
            lease = (await rpc.LeaseStub(channel).LeaseGrant(rpc.LeaseGrantRequest(TTL=30), timeout=2)).ID
        await rpc.KVStub(channel).Put(rpc.PutRequest(key=key, value=value, lease=lease), timeout=2)


def warned(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    """Whether a warning's fields (logs.event's) mention ``text``."""
    return any(text in str(getattr(record, "tensorwire_fields", "")) for record in caplog.records)


@pytest.mark.slow  # starts etcd
@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_a_garbage_leader_value_reads_as_none_and_is_never_taken_over(
    etcd: LocalEtcd, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    slot = f"garbage-{name}"

    async def go() -> None:
        await raw_put(etcd, leader_key("/tensorwire", slot), GARBAGE[name], leased=True)
        async with open_coordinator(etcd.url, timeout=2.0) as coordinator:
            with caplog.at_level(logging.WARNING, logger="tensorwire.coordinator"):
                assert await coordinator.leader(slot) is None
            assert "no valid leader" in caplog.text
            assert warned(caplog, slot)
            assert await coordinator.campaign(slot, "m", "tcp://m:7070", 1) is None
            watch = coordinator.watch(slot)
            assert await asyncio.wait_for(anext(watch), 2.0) is None

    run(go())


@pytest.mark.slow  # starts etcd
def test_a_key_held_by_no_lease_is_no_leader(etcd: LocalEtcd, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        good = b'{"v":1,"member":"m","address":"tcp://m:7070"}'
        await raw_put(etcd, leader_key("/tensorwire", "unleased"), good, leased=False)
        async with open_coordinator(etcd.url, timeout=2.0) as coordinator:
            with caplog.at_level(logging.WARNING, logger="tensorwire.coordinator"):
                assert await coordinator.leader("unleased") is None
            assert warned(caplog, "held by no lease")
            assert await coordinator.campaign("unleased", "x", "tcp://x:7070", 1) is None

    run(go())


@pytest.mark.slow  # starts etcd
def test_a_watch_reads_garbage_written_under_it_as_no_leader(etcd: LocalEtcd) -> None:
    async def go() -> None:
        async with open_coordinator(etcd.url, timeout=2.0) as coordinator:
            watch = coordinator.watch("overwritten")
            assert await asyncio.wait_for(anext(watch), 2.0) is None
            await raw_put(etcd, leader_key("/tensorwire", "overwritten"), GARBAGE["huge"], leased=True)
            assert await asyncio.wait_for(anext(watch), 2.0) is None
            await raw_put(etcd, leader_key("/tensorwire", "overwritten"), GARBAGE["wrong-types"], leased=True)
            assert await asyncio.wait_for(anext(watch), 2.0) is None

    run(go())


# -- endpoints that never answer ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def endpoint(reply: bytes | None) -> AsyncIterator[str]:
    """A TCP server on loopback that reads everything and answers ``reply`` once (None: never)."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        if reply is not None:
            writer.write(reply)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"etcd://127.0.0.1:{port}/tensorwire"
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


FAKE_TERM = Term("s", "m", "tcp://m:7070", epoch=5, lease_id=77, ttl=3.0, renewed_at=0.0)


async def bounded(call: Callable[[], Awaitable[object]], raises: bool = True) -> None:
    started = time.monotonic()
    if raises:
        with pytest.raises(CoordinatorUnavailable):
            await call()
    else:
        await call()
    assert time.monotonic() - started < TIMEOUT + MARGIN


@pytest.mark.parametrize(
    "reply", [None, b"HTTP/1.1 200 OK\r\n\r\n", b"\x00" * 64], ids=["silent", "http1", "zeros"]
)
def test_an_endpoint_that_never_answers_etcd_fails_every_call_within_the_timeout(reply: bytes | None) -> None:
    async def go() -> None:
        async with endpoint(reply) as url:
            coordinator = open_coordinator(url, timeout=TIMEOUT)
            try:
                await bounded(lambda: coordinator.campaign("s", "m", "tcp://m:7070", 3))
                await bounded(lambda: coordinator.renew(FAKE_TERM))
                await bounded(lambda: coordinator.leader("s"))
                await bounded(lambda: anext(coordinator.watch("s")))
                await bounded(lambda: coordinator.resign(FAKE_TERM), raises=False)  # logged, not raised
            finally:
                await coordinator.close()

    run(go())


@pytest.mark.slow  # starts etcd
@needs_etcd
def test_an_endpoint_list_moves_past_a_silent_endpoint(etcd: LocalEtcd) -> None:
    async def go() -> None:
        async with endpoint(None) as silent:
            hosts = f"{silent.split('/')[2]},127.0.0.1:{etcd.client_port}"
            async with open_coordinator(f"etcd://{hosts}/tensorwire", timeout=TIMEOUT) as coordinator:
                with pytest.raises(CoordinatorUnavailable):
                    await coordinator.leader("s")
                assert await coordinator.leader("s") is None  # the next endpoint answers

    run(go())
