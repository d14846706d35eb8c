"""Timeouts and close: a silent server, a closed client and server, a stalled request, idle and
surplus connections, deadlines of requests in flight together, a drop noticed while idle."""

from __future__ import annotations

import asyncio
import time

import torch

from tensorwire import AsyncClient, ClientOptions, errors, transport
from tensorwire._aio import within
from tensorwire.client.options import transport_options
from tensorwire.server.options import ConnectionOptions
from tensorwire.testing.conformance.frames import (
    expect_error,
    put_frame,
    raw,
    read_reply,
)
from tensorwire.testing.conformance.harness import Harness
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.transport.ranged import RangedTransport
from tensorwire.types import Address, TensorMeta
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import Header, Opcode, encode_frame_head


async def silent_server_times_out(h: Harness) -> None:
    async with h.black_hole() as url:
        client = AsyncClient(url, ClientOptions(timeout=0.3, connect_timeout=0.3, retries=1, backoff=0.01))
        start = time.monotonic()
        try:
            await client.ping()
        except (errors.TransferTimeout, errors.ConnectError) as exc:
            assert any(w in str(exc) for w in ("HELLO", "ping", "connect", "handshake")), exc
        else:
            raise AssertionError("a silent server did not time out")
        finally:
            await client.close()
        assert time.monotonic() - start < 5


async def closed_client_and_server(h: Harness) -> None:
    async with h.server() as srv:
        # A connect timeout for a loaded machine (an RDMA attach starts an engine); a closed
        # server refuses at once, so the failures below do not wait for it.
        async with h.client(srv, retries=1, backoff=0.01, connect_timeout=5.0) as c:
            await c.put("x", torch.ones(1))
            await srv.close()  # the server goes away under a connected client
            try:
                await c.get("x")
            except errors.TransportError:
                pass
            else:
                raise AssertionError("a call to a closed server succeeded")
        try:
            await c.ping()
        except errors.ConnectError:
            pass
        else:
            raise AssertionError("a closed client still worked")


async def a_stalled_request_is_cut_off(h: Harness) -> None:
    async with h.server(capacity=1 << 20, connections=ConnectionOptions(stall_timeout=0.5)) as srv:
        async with raw(srv) as (stream, reader):
            idle_since = time.monotonic()
            await stream.send([put_frame([TensorMeta("s/x", torch.uint8, (1,), 1)], b"x", rid=1)])
            await read_reply(reader)  # a finished request, then idleness: never cut off
            frame = put_frame([TensorMeta("s/big", torch.uint8, (900_000,), 900_000)], bytes(900_000), rid=2)
            await asyncio.sleep(0.8)  # idle for longer than the stall timeout, on purpose
            await stream.send([frame[: len(frame) // 3]])  # then a third of a request, and silence
            assert not await within(reader.at_frame_start(), 5), "a stalled request was kept"
            assert time.monotonic() - idle_since > 0.8
        async with h.client(srv) as c:
            await c.delete("s/x")
            await c.put("s/full", torch.zeros(1000_000, dtype=torch.uint8))  # the reservation is free


async def connections_are_bounded_and_idle_ones_dropped(h: Harness) -> None:
    async with h.server(connections=ConnectionOptions(max_connections=2, idle_timeout=0.3)) as srv:
        async with raw(srv) as (one, one_reader), raw(srv) as (two, _):
            ping = Header(1, Opcode.PING, 0, ChecksumKind.XXH3_64, 1, 0, 4096, 0)
            await one.send([encode_frame_head(ping, b"")])
            await read_reply(one_reader)  # both sessions exist now
            await two.send([encode_frame_head(ping, b"")])
            async with raw(srv) as (_, third_reader):
                await expect_error(third_reader, errors.ErrorCode.LIMIT_EXCEEDED)
                assert not await within(third_reader.at_frame_start(), 5)
            # then both sit idle: each is closed after idle_timeout, well within this wait
            assert not await within(one_reader.at_frame_start(), 5), "an idle session was kept"
        async with h.client(srv) as c:  # room again; a client reconnects without noticing
            await c.ping()
            await asyncio.sleep(0.6)  # idle past the timeout, on purpose
            await c.ping()


async def each_request_keeps_its_own_deadline(h: Harness) -> None:
    """A short request sent after a long one times out at its own deadline, not the long one's
    (the client keeps one timer for all, armed for the earliest)."""
    async with h.black_hole() as url:
        t = await _transport(url, timeout=30.0, connect=False)
        try:
            slow = asyncio.create_task(t.call(Opcode.PING, b"", what="slow ping"))
            await asyncio.sleep(0)  # one loop turn: the slow request goes out (and arms the timer) first
            start = time.monotonic()
            try:
                await t.call(Opcode.PING, b"", what="quick ping", timeout=0.3)
            except errors.TransferTimeout as exc:
                assert "quick ping" in str(exc), exc
            else:
                raise AssertionError("a silent server answered")
            assert time.monotonic() - start < 5, "the short request waited for the long one's deadline"
            # The timeout dropped the connection: the long request fails with it, now.
            (outcome,) = await within(asyncio.gather(slow, return_exceptions=True), 5)
            assert isinstance(outcome, errors.TransportError), outcome
        finally:
            await t.close()


async def a_connection_dropped_while_idle_is_noticed(h: Harness) -> None:
    """The server drops a connection the client is not using (its idle timeout): the transport sees
    it without sending anything, though no reader task runs while it is idle (callers read their
    own answers). That is what lets a client's next request, even one never retried (a delete),
    go out on a fresh connection instead of failing on the dead one."""
    async with h.server(connections=ConnectionOptions(idle_timeout=0.3)) as srv:
        t = await _transport(str(srv.addresses[0]), timeout=10.0)
        try:
            await t.ping()
            deadline = time.monotonic() + 5
            while not t.closed:
                assert time.monotonic() < deadline, "an idle connection the server dropped looks open"
                await asyncio.sleep(0.02)
        finally:
            await t.close()


async def _transport(url: str, timeout: float, connect: bool = True) -> FramedTransport:
    """A frame transport to ``url``: opened as a client opens it (HELLO), or, for a peer that
    never answers, on a bare stream."""
    address = Address.parse(url)
    if not connect:
        return RangedTransport(address, await transport.connect_stream(address, 5.0), timeout=timeout)
    options = transport_options(ClientOptions(timeout=timeout, connect_timeout=5.0, retries=0))
    opened = await transport.open_transport(address, options)
    assert isinstance(opened, FramedTransport), opened
    return opened
