"""The transfer engine's own TCP sockets, found in this process and kept to what was asked for.

The Mooncake engine (0.3.x, peer-to-peer handshake mode) opens its handshake port, and in TCP mode
a data port, on every interface, whatever address it is started on: the library has no setting
for it. ``EnginePorts.around`` finds the listening sockets an engine's start added to this
process (Linux ``/proc/self``: descriptors and the TCP tables), so that

* an engine asked for a loopback address is confined to the loopback interface
  (``SO_BINDTODEVICE`` on its listening sockets: a connection arriving on any other interface finds
  no listener), and an engine asked for another address says plainly that it listens everywhere;
* the connections peers opened to its data port can be cut (``cut``): in TCP mode the engine
  checks an address against the registered buffers once per request, then keeps writing into (or
  reading from) that memory for as long as the peer sends, even after the buffer is unregistered;
  cutting the connections is the only way to end such a request.

Every descriptor is checked to be the same socket (its inode) before anything is done to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger("tensorwire.rdma")
LISTEN, ESTABLISHED = "0A", "01"
WILDCARDS = ("0.0.0.0", "::")
LOOPBACK_DEVICE = b"lo"
_STARTING = threading.Lock()  # one engine starts at a time: the sockets that appear are its own
T = TypeVar("T")


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process: its descriptor, inode, local address and state."""

    fd: int
    inode: int
    host: str
    port: int
    state: str


def _descriptors() -> dict[int, int]:
    """inode -> descriptor of every socket this process holds."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    found[int(target[8:-1])] = int(name)
    return found


def _address(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (the TCP tables' little-endian hex) -> ("127.0.0.1", 8080)."""
    raw, port = text.split(":")
    packed = bytes.fromhex(raw)
    words = b"".join(packed[i : i + 4][::-1] for i in range(0, len(packed), 4))  # each u32 is host order
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    host = socket.inet_ntop(family, words)
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, int(port, 16)


def tcp_sockets() -> list[TcpSocket]:
    """This process's TCP sockets (empty where ``/proc`` cannot be read)."""
    fds = _descriptors()
    found: list[TcpSocket] = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows, None)
            for row in rows:
                parts = row.split()
                inode = int(parts[9]) if len(parts) > 9 and parts[9].isdigit() else 0
                if inode in fds:
                    host, port = _address(parts[1])
                    found.append(TcpSocket(fds[inode], inode, host, port, parts[3]))
    return found


@contextlib.contextmanager
def _same_socket(sock: TcpSocket) -> Iterator[socket.socket | None]:
    """A duplicate of ``sock``'s descriptor while it still is that socket (else None): the number
    may have been closed and drawn again for another file since it was listed."""
    try:
        dup = os.dup(sock.fd)
    except OSError:
        yield None
        return
    if os.fstat(dup).st_ino != sock.inode:
        os.close(dup)
        yield None
        return
    with socket.socket(fileno=dup) as handle:  # closes the duplicate, never the engine's descriptor
        yield handle


@dataclass
class EnginePorts:
    """The listening sockets one engine's start added to this process, and what was done to them."""

    listening: list[TcpSocket] = field(default_factory=list)
    confined: bool = False  # to the loopback interface

    @classmethod
    def around(cls, start: Callable[[], T]) -> tuple[T, EnginePorts]:
        """``start()`` (an engine's initialization) and the wildcard listening sockets it added."""
        with _STARTING:
            before = {s.inode for s in tcp_sockets()}
            result = start()
            added = [s for s in tcp_sockets() if s.inode not in before and s.state == LISTEN]
        return result, cls([s for s in added if s.host in WILDCARDS])

    @property
    def ports(self) -> list[int]:
        return sorted({s.port for s in self.listening})

    def confine_to_loopback(self) -> None:
        """Accept connections only from the loopback interface; OSError if one socket refuses."""
        for sock in self.listening:
            with _same_socket(sock) as handle:
                if handle is not None:
                    handle.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, LOOPBACK_DEVICE)
        self.confined = bool(self.listening)

    def connections(self, ports: list[int]) -> list[TcpSocket]:
        """The connections peers opened to ``ports`` (accepted by the engine), now."""
        return [s for s in tcp_sockets() if s.port in ports and s.state != LISTEN]

    def cut(self, ports: list[int], timeout: float = 2.0) -> bool:
        """Shut down every connection peers opened to ``ports`` and wait (up to ``timeout``) for
        the engine to close them: True once none is left, when no request of a peer can still
        touch memory the engine was told about before."""
        victims = self.connections(ports)
        for sock in victims:
            with _same_socket(sock) as handle, contextlib.suppress(OSError):
                if handle is not None:
                    handle.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        inodes = {s.inode for s in victims}
        while True:
            left = inodes & {s.inode for s in self.connections(ports)}
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if left:
            log.warning("%d engine connections were not closed within %.3gs", len(left), timeout)
        return not left

    def describe(self) -> list[dict[str, object]]:
        """STATUS: each port and where it accepts connections from."""
        where = "loopback" if self.confined else "all interfaces"
        return [{"port": port, "accepts": where} for port in self.ports]


__all__ = ["EnginePorts", "TcpSocket", "tcp_sockets"]
