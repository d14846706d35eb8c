"""The transfer engine's own TCP sockets, found in this process and kept to what was asked for.

The Mooncake engine (0.3.x, peer-to-peer handshake mode) opens its handshake port, and in TCP mode
a data port, on every interface, whatever address it is started on: the library has no setting
for it. ``EnginePorts.around`` finds the listening sockets an engine's start added to this
process (Linux ``/proc/self``: descriptors and the TCP tables), so that

* an engine is kept to the interface it was asked for (``SO_BINDTODEVICE`` on its listening
  sockets: a connection arriving on any other interface finds no listener): the loopback
  interface for a loopback address, the interface that holds the address for another one
  (``interface_of``: a client on the same host that connects to that address arrives on it too);
* the connections peers opened to its ports are bounded (``Guard``): the engine accepts every
  connection and keeps it until the peer closes it, a silent one included, each a descriptor of
  this process; one that sends nothing within a grace period is no engine and is shut down, and
  beyond a bound the most idle ones are;
* the connections peers opened to its data port can be cut (``cut``): in TCP mode the engine
  checks an address against the registered buffers once per request, then keeps writing into (or
  reading from) that memory for as long as the peer sends, even after the buffer is unregistered;
  cutting the connections is the only way to end such a request.

Every descriptor is checked to be the same socket (its inode) before anything is done to it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import psutil

log = logging.getLogger("tensorwire.rdma")
LISTEN, ESTABLISHED = "0A", "01"
WILDCARDS = ("0.0.0.0", "::")
LOOPBACK_DEVICE = "lo"
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
    queued: int = 0  # a listener: connections waiting in its accept queue (the table's rx_queue)


def _descriptors() -> dict[int, int]:
    """inode -> descriptor of every socket this process holds (a socket descriptor's inode is the
    one the TCP tables name)."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                info = os.fstat(int(name))
                if stat.S_ISSOCK(info.st_mode):
                    found[info.st_ino] = int(name)
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
                    queued = int(parts[4].partition(":")[2] or "0", 16)
                    found.append(TcpSocket(fds[inode], inode, host, port, parts[3], queued))
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
    confined: str | None = None  # the interface they accept connections on, once confined

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

    def confine(self, device: str) -> None:
        """Accept connections only from the interface ``device``; OSError if one socket refuses."""
        for sock in self.listening:
            with _same_socket(sock) as handle:
                if handle is not None:
                    handle.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
        self.confined = device if self.listening else None

    def confine_to_loopback(self) -> None:
        """Accept connections only from the loopback interface; OSError if one socket refuses."""
        self.confine(LOOPBACK_DEVICE)

    def connections(self, ports: list[int]) -> list[TcpSocket]:
        """The connections peers opened to ``ports`` (accepted by the engine), now."""
        return [s for s in tcp_sockets() if s.port in ports and s.state != LISTEN]

    def cut(self, ports: list[int], timeout: float = 2.0) -> bool:
        """Shut down every connection peers opened to ``ports`` and wait (up to ``timeout``) for
        the engine to close them: True once none is left, when no request of a peer can still
        touch memory the engine was told about before."""
        victims = self.connections(ports)
        for sock in victims:
            _shut(sock)
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
        if self.confined is None:
            where = "all interfaces"
        else:
            where = "loopback" if self.confined == LOOPBACK_DEVICE else f"interface {self.confined}"
        return [{"port": port, "accepts": where} for port in self.ports]


def _shut(sock: TcpSocket) -> None:
    """Shut ``sock`` down (the engine then sees its peer gone and closes its descriptor)."""
    with _same_socket(sock) as handle, contextlib.suppress(OSError):
        if handle is not None:
            handle.shutdown(socket.SHUT_RDWR)


# -- the interface that holds an address ---------------------------------------------------------
def interface_of(host: str) -> str | None:
    """The name of the interface that holds the address ``host`` (an IP address; IPv4-mapped
    IPv6 counts as IPv4), or None: a host name, or an address of no interface here."""
    try:
        target = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(target, ipaddress.IPv6Address) and target.ipv4_mapped is not None:
        target = target.ipv4_mapped
    try:
        interfaces = psutil.net_if_addrs()
    except OSError:
        return None
    for name, addresses in interfaces.items():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6) and _same_ip(address.address, target):
                return str(name)
    return None


def _same_ip(text: str, target: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0]) == target  # fe80::1%eth0: the zone goes
    except ValueError:
        return False


# -- bounding the connections peers hold open to an engine's ports ------------------------------
# The guard lists the engine's sockets through the kernel's socket diagnostics (sock_diag,
# filtered to the engine's ports by the kernel, with each connection's tcp_info): reading the
# whole text TCP table and every descriptor's link takes tens of milliseconds with a thousand
# sockets. Where sock_diag cannot be had, the tables and getsockopt(TCP_INFO) serve.
# netlink framing (sock_diag rides on it)
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_NLMSG_HEAD = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_RTATTR = struct.Struct("=HH")  # length, type
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_INFO = struct.Struct("=52xI72xQ")  # tcp_info: last_data_recv (ms) at 52, bytes_received at 128
_SOCK_DIAG_BY_FAMILY, _INET_DIAG_REQ_BYTECODE, _INET_DIAG_INFO = 20, 1, 2
_BC_S_GE, _BC_S_LE = 2, 3
_DIAG_REQ = struct.Struct("=BBBxI48x")  # family, protocol, extensions, states, socket id (a dump: 0)
# inet_diag_msg: family, state, timer, retrans, sport (big-endian), dport, addresses, interface,
# cookie, expires, rqueue (a listener: its accept queue), wqueue, uid, inode
_DIAG_MSG = struct.Struct("=BBBBHH44xIIIII")
SWEEP_SPACING = 0.02  # seconds at least between two sweeps (a flood wakes the guard per connection)


@dataclass(frozen=True)
class Peer:
    """One socket on an engine port: a connection a peer opened (how long since it last sent, or
    since it was opened, and whether it ever sent a byte), or a listener (``queued``: connections
    waiting to be accepted)."""

    inode: int
    port: int
    state: str
    quiet: float = 0.0
    silent: bool = False
    queued: int = 0


def engine_peers(ports: list[int]) -> list[Peer]:
    """The sockets on ``ports`` (this process's engine's: nothing else here listens on them), but
    connections still in a listener's accept queue (no descriptor yet: counted in its ``queued``)."""
    try:
        found = [p for family in (socket.AF_INET, socket.AF_INET6) for p in _diag(family, ports)]
    except OSError:
        return _from_tables(ports)
    return [p for p in found if p.inode]


def _diag(family: int, ports: list[int]) -> list[Peer]:
    """sock_diag: the TCP sockets of ``family`` whose local port is one of ``ports``."""
    request = _DIAG_REQ.pack(family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0xFFFFFFFF)
    code = _port_filter(ports)
    request += _RTATTR.pack(_RTATTR.size + len(code), _INET_DIAG_REQ_BYTECODE) + code
    found: list[Peer] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) as link:  # NETLINK_SOCK_DIAG
        link.settimeout(2.0)
        head = _NLMSG_HEAD.pack(
            _NLMSG_HEAD.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0
        )
        link.send(head + request)
        while True:
            data = link.recv(1 << 16)
            offset = 0
            while offset + _NLMSG_HEAD.size <= len(data):
                length, kind, _, _, _ = _NLMSG_HEAD.unpack_from(data, offset)
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR or length < _NLMSG_HEAD.size:
                    raise OSError("sock_diag refused the request")
                found.append(_diag_peer(data[offset + _NLMSG_HEAD.size : offset + length]))
                offset += (length + 3) & ~3


def _port_filter(ports: list[int]) -> bytes:
    """inet_diag bytecode accepting a socket whose local port is one of ``ports``: per port a
    ``>=`` and a ``<=``; a jump to the end accepts, one past it rejects."""
    size = 16 * len(ports)
    code = b""
    for i, port in enumerate(ports):
        here, last = 16 * i, i == len(ports) - 1
        left = size - here - 8  # from the second op of this port to the end
        code += _op(_BC_S_GE, 8, left + 12 if last else 16, port)
        code += _op(_BC_S_LE, left, left + 4 if last else 8, port)
    return code


def _op(code: int, yes: int, no: int, port: int) -> bytes:
    """A port comparison: the op (jump ``yes`` bytes when true, ``no`` when false), then the port."""
    return struct.pack("=BBHBBH", code, yes, no, 0, 0, port)


def _diag_peer(message: bytes) -> Peer:
    _, state, _, _, sport, _, _, queued, _, _, inode = _DIAG_MSG.unpack_from(message)
    port = socket.ntohs(sport)
    quiet, silent = 0.0, False
    pos = _DIAG_MSG.size
    while pos + _RTATTR.size <= len(message):
        size, kind = _RTATTR.unpack_from(message, pos)
        if size < _RTATTR.size:
            break
        if kind == _INET_DIAG_INFO:
            quiet, silent = _idle(message[pos + _RTATTR.size : pos + size])
        pos += (size + 3) & ~3
    return Peer(inode, port, f"{state:02X}", quiet, silent, queued)


def _idle(info: bytes) -> tuple[float, bool]:
    """(seconds since the peer last sent, or since the connection opened; whether it never sent)
    from a tcp_info (a kernel without bytes_received, before Linux 4.1: never silent)."""
    if len(info) < _INFO.size:
        return (struct.unpack_from("=I", info, 52)[0] / 1000 if len(info) >= 56 else 0.0), False
    quiet, received = _INFO.unpack_from(info)
    return quiet / 1000, received == 0


def _from_tables(ports: list[int]) -> list[Peer]:
    """``engine_peers`` from the TCP tables and getsockopt (where sock_diag cannot be had)."""
    found: list[Peer] = []
    for sock in tcp_sockets():
        if sock.port not in ports:
            continue
        quiet, silent = 0.0, False
        if sock.state != LISTEN:
            with _same_socket(sock) as handle, contextlib.suppress(OSError):
                if handle is not None:
                    quiet, silent = _idle(handle.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO.size))
        found.append(Peer(sock.inode, sock.port, sock.state, quiet, silent, sock.queued))
    return found


class Guard:
    """Bounds the connections peers hold open to one engine's ports (the listening sockets of an
    ``EnginePorts``), on a thread of its own: a connection that has sent nothing for ``grace``
    seconds is shut down (an engine sends its request as soon as it connects), and beyond
    ``bound`` connections the most idle ones are. ``cut(reason, n)`` is told of each sweep that
    shut some down (reason ``silent`` or ``limit``). The thread wakes when a connection arrives
    (epoll, edge-triggered, on duplicates of the listening sockets), at most every
    ``SWEEP_SPACING`` seconds, and every ``period`` seconds anyway."""

    def __init__(
        self, ports: EnginePorts, bound: int, grace: float, cut: Callable[[str, int], None] | None = None
    ) -> None:
        if bound < 1:
            raise ValueError(f"the engine's connection bound must be at least 1, not {bound}")
        self.ports, self.bound, self.grace = ports, bound, grace
        self._cut = cut
        self.period = min(max(grace, SWEEP_SPACING), 1.0)  # a silent one goes within 2 x grace
        self.shut = {"silent": 0, "limit": 0}  # connections shut down so far, by reason
        self._stop = threading.Event()
        self._poll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        self._poll.register(self._wake_r, select.EPOLLIN)
        self._held: list[socket.socket] = []
        for sock in ports.listening:
            dup = _duplicate(sock)
            if dup is not None:
                self._held.append(dup)
                self._poll.register(dup.fileno(), select.EPOLLIN | select.EPOLLET)
        self._thread = threading.Thread(target=self._run, name="tw-rdma-guard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = self.period
        while not self._stop.is_set():
            try:
                self._poll.poll(wait)
                if self._stop.is_set():
                    return
                # Sooner while a listener has connections waiting to be accepted: the handshake
                # port serves one connection at a time, so a silent one holds up those behind it.
                wait = SWEEP_SPACING if self.sweep() else self.period
            except Exception:  # the guard must outlive one bad sweep: log it, sweep again later
                log.exception("the transfer engine's connection guard failed a sweep")
            self._stop.wait(SWEEP_SPACING)

    def sweep(self) -> bool:
        """Shut down the silent connections, then the most idle ones beyond the bound; whether
        connections wait in a listener's accept queue."""
        found = engine_peers(self.ports.ports)
        peers = [p for p in found if p.state != LISTEN]
        silent = [p for p in peers if p.silent and p.quiet >= self.grace]
        gone = {p.inode for p in silent}
        # The least idle are kept (the newest first among equals), the most idle go.
        rest = sorted((p for p in peers if p.inode not in gone), key=lambda p: (p.quiet, -p.inode))
        if silent or len(rest) > self.bound:
            fds = _descriptors()  # only now: listing them costs a system call per descriptor
            for reason, victims in (("silent", silent), ("limit", rest[self.bound :])):
                shut = [p for p in victims if p.inode in fds]  # else gone already
                for peer in shut:
                    _shut(TcpSocket(fds[peer.inode], peer.inode, "", peer.port, peer.state))
                if shut:
                    self.shut[reason] += len(shut)
                    if self._cut is not None:
                        self._cut(reason, len(shut))
        return any(p.queued for p in found if p.state == LISTEN)

    def close(self) -> None:
        """Stop the thread and let go of the duplicates (before the engine's own close: a
        duplicate keeps its listening socket open)."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        for dup in self._held:
            dup.close()
        self._poll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _duplicate(sock: TcpSocket) -> socket.socket | None:
    """A duplicate of ``sock``'s descriptor, kept (None if the number is no longer that socket)."""
    try:
        dup = os.dup(sock.fd)
    except OSError:
        return None
    if os.fstat(dup).st_ino != sock.inode:
        os.close(dup)
        return None
    return socket.socket(fileno=dup)


__all__ = ["EnginePorts", "Guard", "TcpSocket", "interface_of", "tcp_sockets"]
