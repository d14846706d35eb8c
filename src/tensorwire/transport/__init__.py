"""Transports, chosen by address scheme from one table.

Only this module names the concrete client transports. ``TRANSPORTS`` maps a scheme to the
function that opens a client ``Transport``: the frame protocol (``RangedTransport``) over a
``ByteStream`` for ``tcp://``, ``tls://`` (the same inside TLS) and ``memory://``, the same on
loopback plus shared-memory segments for ``shm://`` (``transport/shm.py``), and gRPC for
``grpc://`` and ``grpcs://`` (gRPC over TLS). ``STREAMS`` holds the
byte-stream kinds (``connect`` and ``listen``); the server's own table of listeners is in
``tensorwire.server``. The scheme a client asked for is the one it gets: no silent fallback.

What a transport can do beyond ``Transport`` is asked of the object it opened (the capability
Protocols of base.py). ``open_channel`` is the one place that opens a connection for requests of
the frame protocol and checks that it is a ``FrameChannel``; ``open_ranged`` the same for
``Ranged`` (striping's lanes). ``CHANNEL_SCHEMES`` lets a command refuse an address before it
connects anywhere (``check_channel``); ``open_channel`` holds it to what the object implements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from tensorwire._aio import asyncio_timeout
from tensorwire.errors import ConnectionLost, TensorwireError, UnsupportedTransport
from tensorwire.security import Security, TlsFiles, client_ssl_context
from tensorwire.transport import memory, shm, tcp, tls
from tensorwire.transport.base import (
    ByteStream,
    FrameChannel,
    Listener,
    Ranged,
    StreamHandler,
    Transport,
)
from tensorwire.transport.frame_client import FramedTransport, RangedTransport
from tensorwire.types import Address
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import DEFAULT_CHUNK_BYTES


class StreamKind(NamedTuple):
    connect: Callable[[Address, float], Awaitable[ByteStream]]
    listen: Callable[[Address, StreamHandler], Awaitable[Listener]]


STREAMS: dict[str, StreamKind] = {
    "tcp": StreamKind(tcp.connect, tcp.listen),
    "memory": StreamKind(memory.connect, memory.listen),
    "shm": StreamKind(tcp.connect, shm.listen_stream),  # the control connection of shm://
}


class TransportOptions(NamedTuple):
    connect_timeout: float
    request_timeout: float
    checksum: ChecksumKind = ChecksumKind.XXH3_64
    chunk_size: int | None = None
    security: Security = Security()
    compression: str = "none"  # lossless chunk codec asked for in HELLO (wire/lossless.py)


async def _open_framed(
    address: Address, options: TransportOptions, kind: type[FramedTransport] = RangedTransport
) -> FramedTransport:
    """The frame protocol over a byte stream: connect (TLS handshake for tls://), then agree on a
    version and authenticate (HELLO)."""
    if address.scheme == "tls":
        context = client_ssl_context(options.security.tls or TlsFiles())
        stream: ByteStream = await tls.connect(address, options.connect_timeout, context)
    else:
        stream = await connect_stream(address, options.connect_timeout)
    chunk = options.chunk_size if options.chunk_size is not None else DEFAULT_CHUNK_BYTES
    transport = kind(
        address, stream, options.checksum, chunk, options.request_timeout, compression=options.compression
    )
    try:
        async with asyncio_timeout(options.connect_timeout, f"the HELLO answer from {address}"):
            await transport.hello(options.security.token)
    except ConnectionLost as exc:
        await transport.close()
        hint = "" if address.scheme == "tls" else " (is it a tls:// server?)"
        raise ConnectionLost(f"{address} closed the connection before answering HELLO{hint}") from exc
    except BaseException:
        await transport.close()
        raise
    return transport


async def _open_shm(address: Address, options: TransportOptions) -> Transport:
    """shm://: the frame protocol on loopback for control, then SHM_ATTACH proves that this process
    maps the server's segments (SharedMemoryUnavailable if not: never a silent fallback)."""
    transport = await _open_framed(address, options, shm.ShmTransport)
    assert isinstance(transport, shm.ShmTransport)
    try:
        async with asyncio_timeout(options.connect_timeout, f"the SHM_ATTACH answer from {address}"):
            await transport.attach()
    except BaseException:
        await transport.close()
        raise
    return transport


async def _open_rpc(address: Address, options: TransportOptions) -> Transport:
    from tensorwire.transport import rpc  # grpcio loads only for grpc:// addresses

    return await rpc.open_transport(address, options)


TRANSPORTS: dict[str, Callable[[Address, TransportOptions], Awaitable[Transport]]] = {
    "tcp": _open_framed,
    "tls": _open_framed,
    "memory": _open_framed,
    "grpc": _open_rpc,
    "grpcs": _open_rpc,
    "shm": _open_shm,
}


# The schemes whose transports are FrameChannels: what open_channel accepts (it checks the object
# too, so this cannot drift unnoticed). Only for refusing an address before connecting anywhere.
CHANNEL_SCHEMES = ("tcp", "tls", "memory", "shm")


def check_scheme(address: Address) -> None:
    """ValueError naming the known schemes, for an address no transport serves."""
    if address.scheme not in TRANSPORTS:
        known = ", ".join(f"{s}://" for s in TRANSPORTS)
        raise ValueError(f"unsupported address scheme in {address}; known: {known}")


def stream_kind(address: Address) -> StreamKind:
    try:
        return STREAMS[address.scheme]
    except KeyError:
        known = ", ".join(f"{s}://" for s in STREAMS)
        raise ValueError(f"{address} is not a byte-stream address; those are: {known}") from None


async def connect_stream(address: Address, timeout: float) -> ByteStream:
    """A raw stream to a server (the conformance suite uses it to send hand-made frames)."""
    return await stream_kind(address).connect(address, timeout)


async def listen(address: Address, handler: StreamHandler) -> Listener:
    return await stream_kind(address).listen(address, handler)


async def open_transport(address: Address, options: TransportOptions) -> Transport:
    """Connect to ``address`` with the transport its scheme names, and return it open."""
    check_scheme(address)
    return await TRANSPORTS[address.scheme](address, options)


def check_channel(address: Address | str, *, what: str) -> Address:
    """``address`` (parsed) if its transport carries frames of the tensorwire protocol; else
    UnsupportedTransport (also a ValueError) naming ``what`` needs them and the scheme it got."""
    parsed = Address.parse(address) if isinstance(address, str) else address
    check_scheme(parsed)
    if parsed.scheme not in CHANNEL_SCHEMES:
        raise _unsupported(parsed, what)
    return parsed


async def open_channel(address: Address | str, options: TransportOptions, *, what: str) -> FrameChannel:
    """A connection to ``address`` for requests of the frame protocol (STATUS, DIGEST, the
    parameter server's), open and checked; UnsupportedTransport naming the scheme for an address
    whose transport cannot carry them (gRPC), with nothing left open. ``what`` names the caller in
    that error ("dataset scatter", "the parameter-server worker"). The caller owns the channel:
    it closes it, and opens a new one once it is ``closed`` (see ``FrameChannel``)."""
    parsed = check_channel(address, what=what)
    transport = await open_transport(parsed, options)
    if not isinstance(transport, FrameChannel):
        await _close_quietly(transport)
        raise _unsupported(parsed, what)
    return transport


async def open_ranged(address: Address, options: TransportOptions, *, what: str) -> Ranged:
    """A connection to ``address`` that moves byte ranges (``Ranged``), open and checked; else
    UnsupportedTransport naming ``what`` needed it and the scheme, with nothing left open."""
    transport = await open_transport(address, options)
    if not isinstance(transport, Ranged):
        await _close_quietly(transport)
        raise UnsupportedTransport(f"{what} needs ranged transfers, which {address.scheme}:// lacks")
    return transport


def _unsupported(address: Address, what: str) -> UnsupportedTransport:
    schemes = ", ".join(f"{s}://" for s in CHANNEL_SCHEMES)
    return UnsupportedTransport(f"{what} needs the frame protocol ({schemes}), not {address.scheme}://")


async def _close_quietly(transport: Transport) -> None:
    with contextlib.suppress(TensorwireError):  # refused anyway: how its close went changes nothing
        await transport.close()


__all__ = [
    "CHANNEL_SCHEMES",
    "STREAMS",
    "TRANSPORTS",
    "ByteStream",
    "FrameChannel",
    "Listener",
    "Ranged",
    "Transport",
    "TransportOptions",
    "check_channel",
    "check_scheme",
    "connect_stream",
    "listen",
    "open_channel",
    "open_ranged",
    "open_transport",
]
