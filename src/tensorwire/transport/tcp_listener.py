"""Listening for TCP connections: each accepted socket becomes a stream (``tcp.TcpStream``, or a
TLS one: ``accept``) served by its own task, and every one of them is closed with the listener."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from tensorwire._aio import cancel_and_wait
from tensorwire.errors import ConnectError
from tensorwire.transport.base import Listener, StreamHandler
from tensorwire.transport.tcp import TcpStream
from tensorwire.types import Address

log = logging.getLogger("tensorwire.transport")


Accept = Callable[[socket.socket], Awaitable["TcpStream | None"]]


async def _plain(sock: socket.socket) -> TcpStream:
    return TcpStream(sock)


class TcpListener(Listener):
    """Accepts connections; ``accept`` turns each socket into a stream (TLS does its handshake
    there) or refuses it (None)."""

    def __init__(self, sock: socket.socket, handler: StreamHandler, accept: Accept, scheme: str) -> None:
        self._sock = sock
        self._handler = handler
        self._accept = accept
        host, port = sock.getsockname()[:2]
        self.address = Address(scheme, host, port)
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError:
                # EMFILE and friends: back off instead of spinning, keep serving the others.
                await asyncio.sleep(0.05)
                continue
            task = loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            # Let the connection's task start before the next accept: one the handler refuses at
            # once (a server over its connection limit) is closed in that first step, so a burst
            # of connections never holds a descriptor each while the backlog drains.
            await asyncio.sleep(0)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            stream = await self._accept(conn)
        except Exception as exc:  # a socket the peer reset already, say: this connection only
            conn.close()
            log.debug("dropped a connection before serving it: %r", exc)
            return
        except BaseException:
            conn.close()  # a failed or cancelled TLS handshake must not leak the socket
            raise
        if stream is None:
            return
        try:
            await self._handler(stream)
        finally:
            await stream.close()

    async def close(self) -> None:
        await cancel_and_wait(self._accepting)
        self._sock.close()
        for task in list(self._tasks):  # each task closes its stream on the way out
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def listen(
    address: Address, handler: StreamHandler, accept: Accept = _plain, scheme: str = "tcp"
) -> TcpListener:
    """Bind ``address`` (port 0 picks a free port) and serve each connection with ``handler``."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise ConnectError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
    sock.listen(128)
    sock.setblocking(False)
    return TcpListener(sock, handler, accept, scheme)
