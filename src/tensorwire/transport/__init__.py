"""Transports, chosen by address scheme from one table.

Only this module names the concrete client transports. ``TRANSPORTS`` maps a scheme to the
function that opens a client ``Transport``: the frame protocol (``RangedTransport``) over a
``ByteStream`` for ``tcp://``, ``tls://`` (the same inside TLS) and ``memory://``, the same on
loopback plus shared-memory segments for ``shm://`` (``transport/shm.py``), the same on TCP plus
the Mooncake Transfer Engine for ``rdma://`` (``transport/rdma.py``), and gRPC for
``grpc://`` and ``grpcs://`` (gRPC over TLS). ``STREAMS`` holds the
byte-stream kinds (``connect`` and ``listen``); the server's own table of listeners is in
``tensorwire.server``. The scheme a client asked for is the one it gets: no silent fallback. The
one opt-in exception goes the fast way: with ``prefer_local``, a connection whose server says in
HELLO that it runs on this host and serves shm:// moves there (``local_listener``), and a failed
move keeps the first connection with its reason in ``local_fallback``, warned and counted.

What a transport can do beyond ``Transport`` is asked of the object it opened (the capability
Protocols of base.py). ``open_channel`` is the one place that opens a connection for requests of
the frame protocol and checks that it is a ``FrameChannel``; ``open_ranged`` the same for
``Ranged`` (striping's lanes). ``CHANNEL_SCHEMES`` lets a command refuse an address before it
connects anywhere (``check_channel``); ``open_channel`` holds it to what the object implements.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from tensorwire import topology
from tensorwire._aio import asyncio_timeout
from tensorwire.errors import ConnectionLost, ProtocolError, TensorwireError, UnsupportedTransport
from tensorwire.logs import event
from tensorwire.security import Security, TlsFiles, client_ssl_context, is_loopback
from tensorwire.transport import memory, rdma, shm, tcp, tls
from tensorwire.transport.base import (
    ByteStream,
    FrameChannel,
    Listener,
    Ranged,
    StreamHandler,
    Transport,
    Viewable,
)
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.transport.ranged import RangedTransport
from tensorwire.transport.tcp_listener import listen as listen_tcp
from tensorwire.types import Address
from tensorwire.wire import shm as ws
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import DEFAULT_CHUNK_BYTES

log = logging.getLogger("tensorwire.transport")


class StreamKind(NamedTuple):
    connect: Callable[[Address, float], Awaitable[ByteStream]]
    listen: Callable[[Address, StreamHandler], Awaitable[Listener]]


STREAMS: dict[str, StreamKind] = {
    "tcp": StreamKind(tcp.connect, listen_tcp),
    "memory": StreamKind(memory.connect, memory.listen),
    "shm": StreamKind(tcp.connect, shm.listen_stream),  # the control connection of shm://
    "rdma": StreamKind(tcp.connect, rdma.listen_stream),  # the control connection of rdma://
}


class TransportOptions(NamedTuple):
    connect_timeout: float
    request_timeout: float
    checksum: ChecksumKind = ChecksumKind.XXH3_64
    chunk_size: int | None = None
    security: Security = Security()
    compression: str = "none"  # lossless chunk codec asked for in HELLO (wire/lossless.py)
    # Move to the server's shm:// listener when its HELLO says it runs on this host and serves one
    # (``prefer_local``); a try that fails keeps the first connection, warned and counted.
    prefer_local: bool = False
    # Each wait for an answer keeps the loop polling this many seconds before it sleeps (a client's
    # ``busy_wait``; ``ByteStream.busy_poll``).
    busy_wait: float = 0.0


async def _open_framed(
    address: Address, options: TransportOptions, kind: type[FramedTransport] = RangedTransport
) -> FramedTransport:
    """The frame protocol over a byte stream: connect (TLS handshake for tls://), then agree on a
    version and authenticate (HELLO)."""
    if address.scheme in ("tls", "rdmas"):  # rdmas://: rdma:// with its control connection in TLS
        context = client_ssl_context(options.security.tls or TlsFiles())
        stream: ByteStream = await tls.connect(address, options.connect_timeout, context)
    else:
        stream = await connect_stream(address, options.connect_timeout)
    stream.busy_poll(options.busy_wait)
    chunk = options.chunk_size if options.chunk_size is not None else DEFAULT_CHUNK_BYTES
    transport = kind(
        address, stream, options.checksum, chunk, options.request_timeout, compression=options.compression
    )
    try:
        async with asyncio_timeout(options.connect_timeout, f"the HELLO answer from {address}"):
            await transport.hello(options.security.token)
    except ConnectionLost as exc:
        await transport.close()
        hint = "" if address.scheme in ("tls", "rdmas") else " (is it a tls:// server?)"
        raise ConnectionLost(f"{address} closed the connection before answering HELLO{hint}") from exc
    except BaseException:
        await transport.close()
        raise
    return transport


async def _open_shm(address: Address, options: TransportOptions) -> Transport:
    """shm://: the frame protocol on loopback for control, then SHM_ATTACH proves that this process
    maps the server's segments (SharedMemoryUnavailable if not: never a silent fallback)."""
    return await _open_attached(address, options, shm.ShmTransport, "SHM_ATTACH")


async def _open_rdma(address: Address, options: TransportOptions) -> Transport:
    """rdma://: the frame protocol on TCP for control (HELLO with the token), then RDMA_ATTACH starts
    this process's transfer engine and learns the server's (RdmaUnavailable if either cannot be
    had, or the server serves no RDMA: never a silent fallback to the frames)."""
    return await _open_attached(address, options, rdma.RdmaTransport, "RDMA_ATTACH")


async def _open_attached(
    address: Address, options: TransportOptions, kind: type[shm.ShmTransport | rdma.RdmaTransport], what: str
) -> Transport:
    """The frame protocol for control, then the transport's own ``attach`` (``what``), within the
    connect timeout; closed again if that fails."""
    transport = await _open_framed(address, options, kind)
    assert isinstance(transport, kind)
    try:
        async with asyncio_timeout(options.connect_timeout, f"the {what} answer from {address}"):
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
    "rdma": _open_rdma,
    "rdmas": _open_rdma,
}


# The schemes whose transports are FrameChannels: what open_channel accepts (it checks the object
# too, so this cannot drift unnoticed). Only for refusing an address before connecting anywhere.
CHANNEL_SCHEMES = ("tcp", "tls", "memory", "shm", "rdma", "rdmas")


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
    """Connect to ``address`` with the transport its scheme names, and return it open; with
    ``prefer_local``, the server's shm:// listener instead where ``local_listener`` finds one."""
    check_scheme(address)
    transport = await TRANSPORTS[address.scheme](address, options)
    if options.prefer_local:
        return await _prefer_local(transport, options)
    return transport


# Connections that tried a server's shm:// listener and kept their first transport, by server URL:
# a fallback to the slower path is counted (and warned about once per server), never silent.
LOCAL_FALLBACKS: collections.Counter[str] = collections.Counter()


def local_listener(transport: Transport) -> Address | None:
    """The shm:// listener ``transport``'s server advertised in HELLO, if it runs on this host (its
    host identity is this process's, ``topology.host_identity``): a place to try, which SHM_ATTACH
    then proves. None when it serves none, runs elsewhere, or ``transport`` maps segments already."""
    where = transport.info.where
    if where is None or not where.shm or isinstance(transport, Viewable):
        return None
    if where.host_id != topology.host_identity(ws.shm_dir()):
        return None
    try:
        listener = Address.parse(where.shm)
    except ValueError:
        return None
    # Only a loopback shm:// address: a server cannot send this client anywhere else.
    return listener if listener.scheme == "shm" and _dialable_loopback(listener.host) else None


def _dialable_loopback(host: str) -> bool:
    """A peer-sent host this client may dial as this machine: a loopback address written as one, or
    ``localhost`` itself. Other spellings that ``is_loopback`` accepts for a listen address
    (``localhost.``) name a host a resolver might look up in DNS, where a spoofer picks
    the host (and the connection carries this client's token)."""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return is_loopback(host)


async def _prefer_local(transport: Transport, options: TransportOptions) -> Transport:
    """``transport``'s server through its shm:// listener when ``local_listener`` names one; else,
    or when that fails, ``transport`` itself, with ``local_fallback`` saying why."""
    listener = local_listener(transport)
    if listener is None:
        return transport
    try:
        local = await _open_shm(listener, options)
    except TensorwireError as exc:
        return _fell_back(transport, listener, exc)
    if local.info.store_id != transport.info.store_id:  # another server listens there
        await _close_quietly(local)
        return _fell_back(transport, listener, ProtocolError("it answers for another store"))
    await _close_quietly(transport)
    return local


def _fell_back(transport: Transport, listener: Address, exc: TensorwireError) -> Transport:
    """Keep ``transport`` after its shm:// ``listener`` failed: say so, count it, warn once."""
    server = str(transport.address)
    transport.local_fallback = f"{listener} failed ({type(exc).__name__}: {exc}); using {server}"
    LOCAL_FALLBACKS[server] += 1
    if LOCAL_FALLBACKS[server] == 1:
        event(log, logging.WARNING, "shared memory unavailable", server=server, listener=str(listener),
              reason=str(exc), using=transport.address.scheme)  # fmt: skip
    return transport


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


# STREAMS, TRANSPORTS and LOCAL_FALLBACKS (the tables behind these functions) are this module's
# own, not its surface: importable, never star-imported.
__all__ = [
    "CHANNEL_SCHEMES",
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
    "local_listener",
    "open_channel",
    "open_ranged",
    "open_transport",
]
