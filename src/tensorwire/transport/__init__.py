"""Transports, chosen by address scheme from one table.

Only this module names the concrete transports. Each stream transport module provides
``connect(address, timeout) -> ByteStream`` and ``listen(address, handler) -> Listener``; the frame
protocol on top (``FramedTransport`` for clients, ``tensorwire.server`` for servers) is the same
for all of them. The scheme a client asked for is the one it gets: there is no silent fallback.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple

from tensorwire._timeouts import asyncio_timeout
from tensorwire.transport import memory, tcp
from tensorwire.transport.base import ByteStream, Listener, StreamHandler, Transport
from tensorwire.transport.framed import FramedTransport
from tensorwire.types import Address
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import DEFAULT_CHUNK_BYTES


class StreamKind(NamedTuple):
    connect: Callable[[Address, float], Awaitable[ByteStream]]
    listen: Callable[[Address, StreamHandler], Awaitable[Listener]]


STREAMS: dict[str, StreamKind] = {
    "tcp": StreamKind(tcp.connect, tcp.listen),
    "memory": StreamKind(memory.connect, memory.listen),
}


def stream_kind(address: Address) -> StreamKind:
    try:
        return STREAMS[address.scheme]
    except KeyError:
        known = ", ".join(f"{s}://" for s in STREAMS)
        raise ValueError(f"unsupported address scheme in {address}; known: {known}") from None


async def connect_stream(address: Address, timeout: float) -> ByteStream:
    """A raw stream to a server (the conformance suite uses it to send hand-made frames)."""
    return await stream_kind(address).connect(address, timeout)


async def listen(address: Address, handler: StreamHandler) -> Listener:
    return await stream_kind(address).listen(address, handler)


async def open_transport(
    address: Address,
    timeout: float,
    checksum: ChecksumKind = ChecksumKind.XXH3_64,
    chunk_size: int | None = None,
    request_timeout: float = 60.0,
) -> Transport:
    """Connect to ``address``, agree on a protocol version, and return the open transport."""
    stream = await connect_stream(address, timeout)
    chunk = chunk_size if chunk_size is not None else DEFAULT_CHUNK_BYTES
    transport = FramedTransport(address, stream, checksum, chunk, timeout=request_timeout)
    try:
        async with asyncio_timeout(timeout, f"the HELLO answer from {address}"):
            await transport.hello()
    except BaseException:
        await transport.close()
        raise
    return transport


__all__ = ["STREAMS", "ByteStream", "Listener", "Transport", "connect_stream", "listen", "open_transport"]
