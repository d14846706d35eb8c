"""The ``ssl`` module's own ceiling in ``bench transfer``: the simplest program that streams through
it, run in the same run on the same CPUs as tls://.

``tls_bound`` puts one core's AES-256-GCM in series with the plain tcp:// path: the best any TLS
could do if sealing were all it added. What Python's ``ssl`` itself adds on top (one
``SSL_write`` record and one socket write per 16 KiB, two reads per record on the receiving side
as OpenSSL 3.0 does by default, a copy out of its record buffer) is measured here, with nothing of
tensorwire's around it: a blocking ``ssl.SSLSocket`` on each side, ``sendall`` of the whole tensor's
bytes from a preallocated buffer and ``recv_into`` a preallocated one, as the socket baseline does
for tcp://, taking turns with tls:// (``SslLoop``). ``tls_ssl_loop_put_gbps`` (this process sends,
the peer child receives and acks with a byte) and ``tls_ssl_loop_get_gbps`` (the child sends);
then ``tls_vs_ssl_loop``: the lower of tls:// put and get over the loop's.

The peer child (``tls_peer``) listens on loopback with the run's development certificate and
serves one connection at a time: a request is 9 bytes (``PUT`` or ``GET``, then the byte count,
u64 little-endian). It streams from, and receives into, one buffer of the run's tensor size that
it allocated at its start; a count larger than that buffer ends the connection.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from tensorwire.bench.children import recv_exactly, serve_until_stopped
from tensorwire.security.tls import TlsFiles, client_ssl_context, server_ssl_context
from tensorwire.wire.tensors import byte_view

PUT, GET = 1, 2
_REQUEST = struct.Struct("<BQ")
TIMEOUT = 120.0  # seconds any one socket call may wait: a transfer of the run's size on a loaded host


def tls_peer(conn: Connection, certs: dict[str, Path], nbytes: int) -> None:
    """Child: serve the loop's transfers of up to ``nbytes`` until the parent says stop."""
    serve_until_stopped(conn, lambda: _start(certs, nbytes))


def _start(certs: dict[str, Path], nbytes: int) -> tuple[int, Callable[[], None]]:
    context = server_ssl_context(TlsFiles(certs["server"], certs["server_key"]))
    buffer = memoryview(bytearray(nbytes))  # its pages are faulted in by the warm-up puts that come first
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # closed: the run is over
                return
            sock.settimeout(TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as tls:// does: acks go at once
            try:
                with context.wrap_socket(sock, server_side=True) as tls:
                    _answer(tls, buffer)
            except OSError:  # the parent went away mid-transfer: the next connection is another's
                continue

    thread = threading.Thread(target=serve, name="tls-loop-peer", daemon=True)
    thread.start()

    def stop() -> None:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (closing alone does not)
        listener.close()
        thread.join(TIMEOUT)

    return listener.getsockname()[1], stop


def _answer(tls: socket.socket, buffer: memoryview) -> None:
    head = memoryview(bytearray(_REQUEST.size))
    while recv_exactly(tls, head):
        op, count = _REQUEST.unpack(head)
        if count > buffer.nbytes or op not in (PUT, GET):
            return
        if op == GET:
            tls.sendall(buffer[:count])
        elif recv_exactly(tls, buffer[:count]):
            tls.sendall(b"\x01")


class SslLoop:
    """A blocking ``ssl.SSLSocket`` to the loop's peer, with a client's ``put`` and ``get`` so that
    it takes turns with the tcp:// and tls:// clients (``bench transfer``'s ``bulk_in_turns``):
    one figure from the same moments of a noisy machine. ``name`` is ignored: the peer holds one
    buffer, which a get returns as the last put left it."""

    def __init__(self, port: int, ca: Path) -> None:
        context = client_ssl_context(TlsFiles(ca=ca))
        raw = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
        except BaseException:
            raw.close()
            raise
        self._ack = memoryview(bytearray(1))

    def put(self, name: str, tensor: torch.Tensor) -> None:
        view = byte_view(tensor)
        self._tls.sendall(_REQUEST.pack(PUT, view.nbytes))
        self._tls.sendall(view)
        _expect(recv_exactly(self._tls, self._ack), "the loop's peer closed before its ack")

    def get(self, name: str, out: torch.Tensor) -> None:
        view = byte_view(out)
        self._tls.sendall(_REQUEST.pack(GET, view.nbytes))
        _expect(recv_exactly(self._tls, view), "the loop's peer closed mid-transfer")

    def close(self) -> None:
        self._tls.close()

    def __enter__(self) -> SslLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def report(put_gbps: float, get_gbps: float, tls_put: float, tls_get: float) -> dict[str, float]:
    """The loop's fields: its rates, and tls:// against them (the lower of put and get, each over
    the loop's own)."""
    return {
        "tls_ssl_loop_put_gbps": put_gbps,
        "tls_ssl_loop_get_gbps": get_gbps,
        "tls_vs_ssl_loop": min(tls_put / put_gbps, tls_get / get_gbps),
    }


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ConnectionError(what)
