"""TLS over TCP: ``tls://host:port``, the frame protocol inside TLS 1.2+ (security/tls.py builds the
contexts). The stream is a ``TcpStream`` whose socket is an ``ssl.SSLSocket``: the same readiness
machinery, plus the two waits TLS adds (a read that needs the peer to speak first, a write that
must wait for room) and no ``sendmsg`` (TLS writes record by record).

A server's stream shakes hands on its first read or write, not in the accept loop: the handshake
runs inside the connection's session, so it counts against the server's connection limit and
falls under its deadline for a connection to authenticate (``Server.auth_timeout``)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable, Sequence

from tensorwire.errors import CertificateRefused, ConnectError, ConnectionLost, TransferTimeout
from tensorwire.transport import tcp
from tensorwire.transport.base import Buffer, StreamHandler
from tensorwire.transport.plain import ReadyIO
from tensorwire.transport.tcp_listener import TcpListener
from tensorwire.transport.tcp_listener import listen as listen_tcp
from tensorwire.types import Address

log = logging.getLogger("tensorwire.server")
_MORE_BYTES = 1 << 20  # most bytes one read takes beyond its first record, before the loop's turn
HANDSHAKE_TIMEOUT = 10.0  # a peer that does not finish its TLS handshake in this time is dropped
# TLS alerts by which a server says it refuses this client's certificate (or its lack of one);
# with TLS 1.3 they arrive after the client's side of the handshake, at its first read.
_REFUSED_CERTIFICATE = frozenset({
    "SSLV3_ALERT_BAD_CERTIFICATE", "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE", "SSLV3_ALERT_CERTIFICATE_REVOKED",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED", "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "TLSV1_ALERT_UNKNOWN_CA",
    "TLSV1_ALERT_ACCESS_DENIED", "TLSV13_ALERT_CERTIFICATE_REQUIRED",
})  # fmt: skip


class TlsStream(tcp.TcpStream):
    _sock: ssl.SSLSocket

    def __init__(
        self, sock: ssl.SSLSocket, *, shake_on_first_use: bool = False, peer: str | None = None
    ) -> None:
        super().__init__(sock)
        if peer is not None:  # a client names the server as its user did (tls://NAME:PORT), not tcp://IP
            self.peer = peer
        # Set on a server's streams. The session that owns one reads or writes, never both at
        # once, before its first frame is in, so one handshake runs at a time.
        self._unshaken = shake_on_first_use

    def lend(self) -> None:
        return None  # its records go through the SSL object; a plain socket twin would skip them

    async def serve_idle(self, serve: Callable[[ReadyIO], bool]) -> bool:
        return False  # the same: the socket's bytes are records, not frames

    async def handshake(self, timeout: float) -> None:
        """Run the TLS handshake; TransferTimeout or ConnectError (naming the reason) on failure."""
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for returns (or raises) the handshake's
            # outcome when it lands in the same turn as a cancellation, and the cancellation is lost
            # (a heartbeat loop cancelled at its handshake's failure then beat on, and a Worker's
            # close waited 20 s for it).
            async with asyncio.timeout(timeout):
                await self._handshake()
        except TimeoutError as exc:
            raise TransferTimeout(f"waited {timeout:.3g}s for the TLS handshake with {self.peer}") from exc

    async def _first_use(self) -> None:
        """The deferred handshake of a server's stream; a failed one ends the connection."""
        try:
            await self.handshake(HANDSHAKE_TIMEOUT)
        except (ConnectError, TransferTimeout) as exc:
            log.info("refused %s: %s", self.peer, exc)
            raise ConnectionLost(str(exc)) from exc
        self._unshaken = False

    async def _handshake(self) -> None:
        while True:
            if self._closed:
                raise ConnectionLost(f"connection to {self.peer} was closed during its TLS handshake")
            try:
                self._sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._readable()
            except ssl.SSLWantWriteError:
                await self._writable()
            except (ssl.SSLError, OSError) as exc:
                self._check_refusal(exc)
                raise ConnectError(f"TLS handshake with {self.peer} failed: {exc}") from exc

    def _check_refusal(self, exc: BaseException) -> None:
        """On a client: CertificateRefused when the failure is one of credentials (the server's
        certificate does not verify, or the server refuses ours), which no retry cures, rather
        than a plain transport error (the peer is down or the link broke, which a retry may)."""
        if self._sock.server_side or not isinstance(exc, ssl.SSLError):
            return
        if isinstance(exc, ssl.SSLCertVerificationError):
            raise CertificateRefused(f"the TLS certificate of {self.peer} does not verify: {exc}") from exc
        if exc.reason in _REFUSED_CERTIFICATE:
            raise CertificateRefused(f"{self.peer} refused this client's TLS certificate: {exc}") from exc

    async def recv_into(self, buf: memoryview) -> int:
        if self._unshaken:
            await self._first_use()
        while True:
            if self._closed:
                raise ConnectionLost(f"connection to {self.peer} is closed")
            try:
                got = self._sock.recv_into(buf)
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                await self._readable()
                continue
            except ssl.SSLWantWriteError:
                await self._writable()
                continue
            except ssl.SSLZeroReturnError:
                return 0  # the peer closed the TLS session cleanly
            except (ssl.SSLError, OSError) as exc:
                self._check_refusal(exc)
                raise ConnectionLost(f"receiving from {self.peer}: {exc}") from exc
            self.last_active = time.monotonic()
            return got + self._more_into(buf, got) if got else 0

    def _more_into(self, buf: memoryview, got: int) -> int:
        """Bytes of further records read into ``buf[got:]`` without waiting: one SSL read returns at
        most one record (16 KiB), and a trip through the event loop per record cost more than the
        record's decryption (get over tls:// went 0.69-0.81 to 0.83-0.97 GB/s). Stops at the first
        read that would wait, or fails (the next call meets that failure again and says it), and
        after ``_MORE_BYTES``: a fast sender must not keep the loop from the other connections."""
        more, size = 0, min(buf.nbytes, got + _MORE_BYTES)
        while got + more < size:
            try:
                n = self._sock.recv_into(buf[got + more : size])
            except (ssl.SSLError, OSError):  # would wait, or failed: the next call sees which
                break
            if not n:
                break
            more += n
        return more

    async def send(self, buffers: Sequence[Buffer]) -> None:
        if self._unshaken:
            await self._first_use()
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            while view.nbytes:
                if self._closed:
                    raise ConnectionLost(f"connection to {self.peer} is closed")
                try:
                    sent = self._sock.send(view)
                except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                    await self._writable()
                    continue
                except ssl.SSLWantReadError:
                    await self._readable()
                    continue
                except (ssl.SSLError, OSError) as exc:
                    raise ConnectionLost(f"sending to {self.peer}: {exc}") from exc
                view = view[sent:]
                self.last_active = time.monotonic()


async def connect(address: Address, timeout: float, context: ssl.SSLContext) -> TlsStream:
    """A TLS stream to ``address``: TCP connect, then a handshake that verifies the server."""
    sock = await tcp.connect_socket(address, timeout)
    try:
        wrapped = context.wrap_socket(sock, do_handshake_on_connect=False, server_hostname=address.host)
    except BaseException:
        sock.close()
        raise
    stream = TlsStream(wrapped, peer=str(address))  # tls://NAME:PORT or rdmas://, [v6] bracketed
    try:
        await stream.handshake(timeout)
    except BaseException:
        await stream.close()
        raise
    return stream


async def listen(address: Address, handler: StreamHandler, context: ssl.SSLContext) -> TcpListener:
    """Serve TLS on ``address``: ``handler`` gets each connection at once; its handshake runs on
    the stream's first read or write (ConnectionLost if it fails or takes ``HANDSHAKE_TIMEOUT``)."""

    async def accept(sock: socket.socket) -> tcp.TcpStream | None:
        sock.setblocking(False)
        wrapped = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return TlsStream(wrapped, shake_on_first_use=True)

    listener = await listen_tcp(address, handler, accept, scheme="tls")
    listener.encrypted = True
    return listener
