"""The dashboard page's listening socket and the thread it runs on inside a server.

``Listener`` accepts connections itself rather than through ``loop.create_server``, so that every
connection counts from the moment it is accepted, its TLS handshake included: at most
``Limits.max_connections`` are open at once and ``Limits.connections_per_client`` from one client
address (IPv6: one /64; one more is closed at once and counted in ``refused``), a handshake has
``Limits.handshake_timeout`` to finish, and each connection is served by the aiohttp request
handler the app runner makes (``protocol``), whose keepalive timeout closes a connection idle
between requests. A connection whose first request's head has not come
in within ``Limits.idle_timeout`` (silent, or sending it byte by byte) is closed here: aiohttp
before 3.14 watches no connection before its first request.

``PageThread`` runs a ``Dashboard`` on a thread and event loop of its own (``serve
--dashboard-port``): the page's HTTP parsing, its streams and its slow readers then cost the
server's event loop nothing but one STATUS read per snapshot (``sources.local``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from tensorwire.dashboard.guard import Limits, client_key

if TYPE_CHECKING:
    from tensorwire.dashboard.app import Dashboard

log = logging.getLogger("tensorwire.dashboard")
ACCEPT_BACKOFF = 0.1  # after accept(2) fails (out of descriptors): wait, rather than spin


class _Counted(asyncio.Protocol):
    """The request handler of one connection, whose end frees its slot (``release``, once), and
    which is closed if its first request's head is not in within ``first_head`` seconds."""

    def __init__(self, inner: asyncio.Protocol, release: Callable[[], None], first_head: float) -> None:
        self.inner, self.release, self.first_head = inner, release, first_head
        self._tail = b""  # the last bytes before the first head's end is seen (it may span reads)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # TCP, or TLS over it (uvloop's are not subclasses)
        self._timer = asyncio.get_running_loop().call_later(self.first_head, stream.abort)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            self.inner.connection_lost(exc)
        finally:
            self.release()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host`` (its first address; "" is every interface) and ``port``."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Listener:
    """Accepts the page's connections (module doc): ``start``, then ``close``."""

    def __init__(
        self,
        protocol: Callable[[], asyncio.Protocol],
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        limits: Limits,
    ) -> None:
        self.protocol, self.host, self.ssl_context, self.limits = protocol, host, ssl_context, limits
        self.port = port
        self.open = 0
        self.by_client: dict[str, int] = {}  # open connections per client address (none at 0)
        self.refused = 0
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._sock = bind(self.host, self.port)
        self.port = int(self._sock.getsockname()[1])
        self._accepting = asyncio.get_running_loop().create_task(self._accept_forever(self._sock))
        return self.port

    async def close(self) -> None:
        """Stop accepting and cut the handshakes under way (open connections are the runner's)."""
        tasks = [t for t in (self._accepting, *self._handshakes) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept_forever(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and the like: the process is short of descriptors
                log.warning("the dashboard could not accept a connection: %s", exc)
                await asyncio.sleep(ACCEPT_BACKOFF)
                continue
            client = client_key(peer[0] if isinstance(peer, tuple) else None)
            held = self.by_client.get(client, 0)
            if self.open >= self.limits.max_connections or held >= self.limits.connections_per_client:
                self.refused += 1
                conn.close()
                continue
            self.open += 1
            self.by_client[client] = held + 1
            task = loop.create_task(self._serve(conn, client))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _serve(self, conn: socket.socket, client: str) -> None:
        """Hand ``conn`` (from ``client``) to a request handler, after its TLS handshake (bounded)
        where there is one."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released, self.open = True, self.open - 1
                left = self.by_client.pop(client, 1) - 1
                if left > 0:
                    self.by_client[client] = left

        try:
            conn.setblocking(False)
            handler = _Counted(self.protocol(), release, self.limits.idle_timeout)
            tls: dict[str, Any] = {}
            if self.ssl_context is not None:
                tls = {"ssl": self.ssl_context, "ssl_handshake_timeout": self.limits.handshake_timeout}
            await asyncio.get_running_loop().connect_accepted_socket(lambda: handler, conn, **tls)
        except BaseException as exc:
            conn.close()
            release()
            if isinstance(exc, asyncio.CancelledError):
                raise
            log.debug("a dashboard connection failed before its first request: %s", exc)


class PageThread:
    """A ``Dashboard`` served on a thread and event loop of its own (module doc). ``start`` returns
    once it is bound (or raises why not); ``close`` stops it and joins the thread."""

    def __init__(self, dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="tensorwire-dashboard", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 30.0) -> int:
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"the dashboard did not start within {timeout}s")
        if self._error is not None:
            raise self._error
        return self.dashboard.port

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            await self.dashboard.start()
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await self.dashboard.close()

    def close(self, timeout: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop already ended
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout)


__all__ = ["Listener", "PageThread", "bind"]
