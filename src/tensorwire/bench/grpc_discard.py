"""grpcio's own ceiling for ``bench grpc``: the streams tensorwire's gRPC transport makes, with
nothing of tensorwire in them.

A server in a child process (``grpc.aio``, as tensorwire's) whose ``Put`` drops every message it
is sent and whose ``Get`` sends one preallocated message again and again; a client (``grpc.aio``
on the same event loop as tensorwire's client) that streams one preallocated message to ``Put``
and counts, then drops, what ``Get`` sends. Messages are the sizes tensorwire's chunks are
(``RPC_CHUNK_BYTES`` up, ``RPC_GET_CHUNK_BYTES`` down), raw bytes both ways: no protobuf, no copy
of a tensor, no checksum. What tensorwire does beyond this (a copy and a checksum per chunk, the
landing in the caller's tensor) is what ``grpc_put_vs_discard`` and ``grpc_get_vs_discard`` price.
"""

from __future__ import annotations

import statistics
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

import grpc

from tensorwire import _aio
from tensorwire.bench.children import starting, until_stopped
from tensorwire.types import Limits
from tensorwire.wire.rpc import RPC_CHUNK_BYTES, RPC_GET_CHUNK_BYTES, message_options

SERVICE = "discard.Discard"
CALL_TIMEOUT = 600.0  # a wedged server fails the run, not hangs it
_GET = struct.Struct("<QQ")  # a Get's request: bytes in all, bytes per message
MAX_GET_BYTES = 1 << 40  # what one Get may ask the server for (a bench: its own client asks)


# -- the server (a child process) --------------------------------------------------------------------
def serve_discard(conn: Connection) -> None:
    """Child: the discarding service on a free loopback port, until the parent says stop."""
    _aio.run(_serve(conn))


async def _serve(conn: Connection) -> None:
    server = grpc.aio.server(options=message_options(Limits().max_chunk_bytes))
    server.add_generic_rpc_handlers((_handler(),))
    with starting(conn):
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(("ready", port))
    try:
        await until_stopped(conn)
    finally:
        await server.stop(None)


def _handler() -> Any:
    async def put(messages: AsyncIterator[bytes], context: Any) -> bytes:
        async for _ in messages:
            pass
        return b""

    async def get(request: bytes, context: Any) -> AsyncIterator[bytes]:
        total, size = _GET.unpack(request)
        if not 0 < size <= Limits().max_chunk_bytes or total > MAX_GET_BYTES:
            raise ValueError(f"a Get of {total} bytes in messages of {size}")
        message = bytes(size)  # preallocated: each send is grpcio's work alone
        for start in range(0, total, size):
            yield message if total - start >= size else message[: total - start]

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Put": grpc.stream_unary_rpc_method_handler(put),
            "Get": grpc.unary_stream_rpc_method_handler(get),
        },
    )


# -- the client (this process) -----------------------------------------------------------------------
def discard_bulk(port: int, nbytes: int, iters: int) -> tuple[float, float]:
    """(put_gbps, get_gbps) of ``nbytes`` into and out of the discarding server at ``port``, with
    the warm-ups tensorwire's bulk put and get have."""
    return _aio.run(_bulk(port, nbytes, iters))


async def _bulk(port: int, nbytes: int, iters: int) -> tuple[float, float]:
    options = message_options(Limits().max_chunk_bytes)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        put_call = channel.stream_unary(f"/{SERVICE}/Put")
        get_call = channel.unary_stream(f"/{SERVICE}/Get")
        chunk = bytes(RPC_CHUNK_BYTES)

        async def messages() -> AsyncIterator[bytes]:
            for start in range(0, nbytes, RPC_CHUNK_BYTES):
                yield chunk if nbytes - start >= RPC_CHUNK_BYTES else chunk[: nbytes - start]

        async def put() -> None:
            await put_call(messages(), timeout=CALL_TIMEOUT)

        async def get() -> None:
            got = 0
            async for message in get_call(_GET.pack(nbytes, RPC_GET_CHUNK_BYTES), timeout=CALL_TIMEOUT):
                got += len(message)
            if got != nbytes:
                raise RuntimeError(f"the discarding server sent {got} bytes, not {nbytes}")

        put_s = await _median_seconds(put, iters, warmup=2)
        get_s = await _median_seconds(get, iters, warmup=1)
    return nbytes / put_s / 1e9, nbytes / get_s / 1e9


async def _median_seconds(fn: Callable[[], Awaitable[None]], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
