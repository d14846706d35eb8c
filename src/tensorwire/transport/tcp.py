"""TCP streams on asyncio (uvloop when installed): ``recv_into`` straight into the destination,
``sendmsg`` of memoryviews, so tensor bytes are never copied in user space."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import select
import socket
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence

from tensorwire._aio import within
from tensorwire.errors import ConnectError, ConnectionLost, TransferTimeout
from tensorwire.transport.base import Buffer, ByteStream
from tensorwire.transport.plain import LentStream, ReadyIO
from tensorwire.transport.spin import Spin, busy_loop
from tensorwire.types import Address

log = logging.getLogger("tensorwire.transport")
SOCKET_BUFFER = 4 << 20  # larger kernel buffers let one syscall move a whole 4 MiB chunk


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


class SocketStream(ByteStream):
    """A connected non-blocking socket's reads and writes: ``recv_into`` straight into the
    destination, ``sendmsg`` of memoryviews. How a wait for readiness is made is the subclass's:
    suspended on the event loop (``TcpStream``), or blocking a borrowing thread (``LentTcp``)."""

    parallel = True  # the kernel copies the bytes: streams on several threads move them at once

    def __init__(self, sock: socket.socket, peer: str, *, drained: bool = False) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self.peer = peer
        self.last_active = time.monotonic()
        self._closed = False
        self._drained = drained  # the last read came back short: the socket is (most likely) empty

    async def recv_into(self, buf: memoryview) -> int:
        # Read first and wait only when the socket is empty; the readiness watch stays registered
        # across waits. (loop.sock_recv_into registers and unregisters it with epoll on every call,
        # which cost a third of a small request's round trip.) A read that came back short has
        # emptied the socket: the next one waits for readiness first rather than pay for a receive
        # that fails with EAGAIN (a syscall and an exception per frame on each side of a small
        # round trip). The watch is level-triggered, so bytes that came in meanwhile wake it at once.
        if self._drained:
            self._drained = False
            await self._readable()
        while (got := self.try_recv(buf)) is None:
            await self._readable()
        return got

    def try_recv(self, buf: memoryview) -> int | None:
        """One receive into ``buf``: how many bytes came (0: the peer closed), None if none are there."""
        if self._closed:
            raise ConnectionLost(f"connection to {self.peer} is closed")
        try:
            got = self._sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise ConnectionLost(f"receiving from {self.peer}: {exc}") from exc
        self.last_active = time.monotonic()
        self._drained = 0 < got < buf.nbytes
        return got

    def try_send(self, data: Buffer) -> int:
        """One send of ``data``: how many bytes the kernel took (0: none fit now)."""
        if self._closed:
            raise ConnectionLost(f"connection to {self.peer} is closed")
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            raise ConnectionLost(f"sending to {self.peer}: {exc}") from exc
        self.last_active = time.monotonic()
        return sent

    async def send(self, buffers: Sequence[Buffer]) -> None:
        if len(buffers) == 1:  # a small frame: usually one syscall, done
            sent = self.try_send(buffers[0])
            if sent == len(buffers[0]):
                return
            buffers = [memoryview(buffers[0])[sent:]]
        views = [memoryview(b) for b in buffers if len(b)]
        i = 0
        while i < len(views):
            if self._closed:
                raise ConnectionLost(f"connection to {self.peer} is closed")
            try:
                sent = self._sock.sendmsg(views[i : i + 512])
            except (BlockingIOError, InterruptedError):
                await self._writable()
                continue
            except OSError as exc:
                raise ConnectionLost(f"sending to {self.peer}: {exc}") from exc
            self.last_active = time.monotonic()
            while sent:  # advance past what the kernel took
                size = views[i].nbytes
                if sent >= size:
                    sent -= size
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    @abstractmethod
    async def _readable(self) -> None:
        """Return once the socket may be read (or raise ConnectionLost, TransferTimeout)."""

    @abstractmethod
    async def _writable(self) -> None:
        """Return once the socket may be written (or raise ConnectionLost, TransferTimeout)."""


class TcpStream(SocketStream):
    """A TCP connection on its event loop: a wait for readiness suspends there (the readiness
    watch stays registered across waits); ``lend`` hands its socket to a ``LentTcp``."""

    def __init__(self, sock: socket.socket) -> None:
        _tune(sock)
        try:
            host, port = sock.getpeername()[:2]
            peer = f"tcp://{host}:{port}"
        except OSError:
            peer = "tcp://?"
        super().__init__(sock, peer)
        self._loop = asyncio.get_running_loop()
        self._watching = False  # whether the loop watches the socket for readability
        self._writing = False  # whether the loop watches it for room to write (a send is parked)
        self._on_idle: Callable[[], None] | None = None  # see watch_idle
        self._read_waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None
        self._spin: Spin | None = None  # see busy_poll
        self._lent: LentTcp | None = None  # the twin a borrowing thread drives (lend), if any
        self._serve: Callable[[ReadyIO], bool] | None = None  # see serve_idle

    async def _readable(self) -> None:
        if self._closed:  # never watch a closed descriptor: its number may be another socket's now
            raise ConnectionLost(f"connection to {self.peer} is closed")
        if self._read_waiter is not None:
            await _join(self._read_waiter)
            return
        waiter = self._read_waiter = self._loop.create_future()
        self._watch()
        spin = self._spin
        try:
            if spin is not None and spin.pays():
                until = time.perf_counter() + spin.seconds
                busy = busy_loop(self._loop)
                busy.spin(until)
                try:
                    await waiter
                finally:
                    busy.done()
                spin.ended(time.perf_counter() <= until)
            else:
                await waiter
        finally:
            self._read_waiter = None

    def busy_poll(self, seconds: float) -> bool:
        # The loop keeps turning (BusyLoop) while a read waits, up to ``seconds`` a wait.
        self._spin = Spin(seconds) if seconds > 0 else None
        return True

    def _on_readable(self) -> None:
        waiter = self._read_waiter
        if waiter is None or waiter.done():
            # Nobody is reading now: stop watching, or the level-triggered poll would call us on
            # every loop turn until someone does; tell whoever asked (watch_idle).
            self._unwatch()
            self._drained = False
            idle, self._on_idle = self._on_idle, None
            if idle is not None:
                idle()
            return
        serve = self._serve
        if serve is None or not serve(self):
            waiter.set_result(None)

    async def serve_idle(self, serve: Callable[[ReadyIO], bool]) -> bool:
        # Served from the readiness callback, a small request costs no future, no task wake-up
        # and no coroutine: the server's CPU per 1 KiB get in ``bench transfer`` went from 76-92
        # to 55-69 us (7 December 2026); the kernel's send and wake-ups are most of what is left.
        if self._spin is not None:
            return False  # a busy-polled wait turns the loop itself; its callers read as usual
        self._serve = serve
        try:
            await self._readable()
        finally:
            self._serve = None
        return True

    def watch_idle(self, callback: Callable[[], None]) -> bool:
        if not self._closed:
            self._on_idle = callback
            self._watch()
        return True

    def lend(self) -> LentStream | None:
        if self._closed or self._read_waiter is not None or self._write_waiter is not None:
            return None
        self._unwatch()
        self._on_idle = None
        self._lent = LentTcp(self._sock, self.peer)
        return self._lent

    def take_back(self) -> bool:
        self._lent = None
        self._drained = False
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        return not poll.poll(0)

    def _watch(self) -> None:
        if not self._watching and not self._closed:
            self._loop.add_reader(self._fd, self._on_readable)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            self._loop.remove_reader(self._fd)

    async def _writable(self) -> None:
        if self._closed:
            raise ConnectionLost(f"connection to {self.peer} is closed")
        if self._write_waiter is not None:
            await _join(self._write_waiter)
            return
        fut = self._write_waiter = self._loop.create_future()
        self._loop.add_writer(self._fd, _resolve, fut)
        self._writing = True
        try:
            await fut
        finally:
            self._write_waiter = None
            self._unwatch_writes()  # already done when close woke us: the descriptor is gone

    def _unwatch_writes(self) -> None:
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)

    async def close(self) -> None:
        """Close once; safe from any task on the loop (the watchdog, the session, a listener's
        close) while a read or a send is parked: each wakes and raises ConnectionLost.

        The order matters. The loop stops watching the descriptor, for reads and for writes, before
        it is closed: libuv (uvloop) aborts the whole process on a closed descriptor it still polls,
        and a parked send's own clean-up would run only after the close, by when the number may be
        a new connection's, whose registration it would remove."""
        if self._closed:
            return
        self._closed = True
        self._on_idle = None
        self._unwatch()
        self._unwatch_writes()
        for waiter in (self._read_waiter, self._write_waiter):
            if waiter is not None:
                _resolve(waiter)  # a blocked reader or writer wakes and sees the stream closed
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # also wakes a borrower asleep in poll(2)
        lent, self._lent = self._lent, None
        if lent is None or lent.let_go():
            self._sock.close()


class LentTcp(SocketStream, LentStream):
    """A lent ``TcpStream``'s socket, driven by a borrowing thread: the same reads and writes, but a
    wait for readiness blocks that thread in poll(2), no later than ``deadline``, rather than
    suspending on the loop, so its coroutines run to their end without one (``_aio.drive``).

    The owner may close the stream (on its loop's thread) while the borrower is in a call
    (``begin`` .. ``end``), asleep in poll(2) or in a syscall. It then only shuts the socket down,
    which wakes the borrower and fails its I/O; ``end`` closes the descriptor (``let_go``). Closed
    under a thread still using it, the descriptor's number could be reused by a new socket before
    that thread's syscall runs, which would then read another connection's bytes. (One hold per
    call, not per read or write: this is the blocking client's small-call path.)"""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        # Lent idle, so a read waits for readiness first (drained). ``_closed`` is this twin's own
        # close: the owner's closes the socket (let_go).
        super().__init__(sock, peer, drained=True)
        self._poll = select.poll()
        self.deadline = 0.0  # time.monotonic() past which a wait raises TransferTimeout
        self.spin = 0.0  # seconds each wait polls without sleeping first (the borrower sets it)
        self._budget = Spin(0.0)  # whether a wait spins (after spins that ran out, not always)
        self._guard = threading.Lock()  # between the owner's close and the borrower's I/O
        self._inside = False  # the borrower is in a call (begin .. end)
        self._orphaned = False  # the owner closed the stream: the socket is no longer ours

    def let_go(self) -> bool:
        """The owner closed the stream (its socket is shut down already): whether the owner may
        close the descriptor now; False while the borrower is using it (it closes it itself)."""
        with self._guard:
            self._orphaned = True
            return not self._inside

    def begin(self) -> bool:
        with self._guard:
            if self._orphaned:
                return False  # closed by its owner meanwhile
            self._inside = True
        self._poll.register(self._fd, select.POLLIN)
        if not self._poll.poll(0):
            return True
        self.end()
        return False

    def end(self) -> None:
        with self._guard:
            self._inside = False
            abandoned = self._orphaned
        if abandoned:
            self._sock.close()  # the owner let go of it meanwhile: nobody else will

    async def recv_into(self, buf: memoryview) -> int:
        return self.recv_now(buf)

    def recv_now(self, buf: memoryview) -> int:
        if self._drained:
            self._drained = False
            self._wait(select.POLLIN)
        while (got := self.try_recv(buf)) is None:
            self._wait(select.POLLIN)
        return got

    def send_now(self, frame: bytes) -> None:
        view = memoryview(frame)
        sent = 0
        while sent < view.nbytes:
            if self._closed:
                raise ConnectionLost(f"connection to {self.peer} is closed")
            try:
                sent += self._sock.send(view[sent:] if sent else view)
            except (BlockingIOError, InterruptedError):
                self._wait(select.POLLOUT)
            except OSError as exc:
                raise ConnectionLost(f"sending to {self.peer}: {exc}") from exc
        self.last_active = time.monotonic()

    async def _readable(self) -> None:
        self._wait(select.POLLIN)

    async def _writable(self) -> None:
        self._wait(select.POLLOUT)

    def _wait(self, events: int) -> None:
        self._poll.register(self._fd, events)  # registering again replaces the events
        self._budget.seconds = self.spin
        if self._budget.pays() and self._spun():
            return
        left = self.deadline - time.monotonic()
        if left <= 0 or not self._poll.poll(math.ceil(left * 1000)):
            raise TransferTimeout(f"{self.peer} did not become ready in time")

    def _spun(self) -> bool:
        """Whether the socket turned ready within ``spin`` seconds of polling without sleeping. A
        small request's answer comes within ~150 us, and a thread asleep in poll(2) wakes ~100 us
        after it does on a VM (its idle CPU halts): ``bench sweep``'s 4 KiB get, 250 us -> 150 us."""
        until = time.perf_counter() + self.spin
        while not self._poll.poll(0):
            if time.perf_counter() >= until:
                self._budget.ended(caught=False)
                return False
        self._budget.ended(caught=True)
        return True

    async def close(self) -> None:
        self._closed = True


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _join(waiter: asyncio.Future[None]) -> None:
    """Wait for readiness another task of the same stream waits for already (over TLS, a send may
    need the peer's records while the session reads, and a read may need room to write), rather
    than replace its waiter: a replaced one is woken by nothing, not even ``close``, and its task
    would hang with the connection's slot. The caller retries its I/O whatever woke this one.

    A waiter already woken still yields once: its owner has not run yet, and a caller whose retried
    I/O wants to wait again (a TLS record half in) would otherwise loop without ever letting it."""
    if waiter.done():
        await asyncio.sleep(0)
        return
    try:
        await asyncio.shield(waiter)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this task's own cancellation; the other waiter's is no reason to stop


async def connect(address: Address, timeout: float) -> TcpStream:
    """Open a TCP stream to ``address`` within ``timeout`` seconds."""
    return TcpStream(await connect_socket(address, timeout))


async def connect_socket(address: Address, timeout: float) -> socket.socket:
    """A connected non-blocking socket to ``address`` within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    try:
        infos = await within(loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM), timeout)
    except (OSError, TimeoutError) as exc:
        raise ConnectError(f"cannot resolve {address}: {exc or 'timed out'}") from exc
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    try:
        await within(loop.sock_connect(sock, sockaddr), timeout)
    except TimeoutError as exc:
        sock.close()
        raise TransferTimeout(f"connecting to {address}: no answer within {timeout:.3g}s") from exc
    except OSError as exc:
        sock.close()
        raise ConnectError(f"cannot connect to {address}: {exc.strerror or exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock
