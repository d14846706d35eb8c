"""The in-process transport: ``memory://name`` streams between a client and a server in one
process, for tests and embedding. The bytes travel through the same frame code as TCP (so the
conformance suite's corrupt-frame cases mean the same thing), over bounded in-memory pipes that
work across event loops in different threads (the sync client runs its own loop)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence

from tensorwire.errors import ConnectError, ConnectionLost
from tensorwire.transport.base import Buffer, ByteStream, Listener, StreamHandler
from tensorwire.types import Address

PIPE_CAPACITY = 4 << 20
_listeners: dict[str, MemoryListener] = {}
_registry_lock = threading.Lock()


class _Pipe:
    """One direction: a bounded byte queue with waiters that may live on other event loops."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._lock = threading.Lock()
        self._closed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            # A waiter's loop may be closed by now (its client stopped without closing the stream):
            # nobody is left to wake there, and the side that wakes it (a server's watchdog, say)
            # must not fail for it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut)

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append((loop, fut))
        self._lock.release()
        try:
            await fut
        finally:
            self._lock.acquire()

    async def write(self, data: memoryview) -> None:
        pos = 0
        self._lock.acquire()
        try:
            while pos < data.nbytes:
                if self._closed:
                    raise ConnectionLost("in-process connection closed")
                room = PIPE_CAPACITY - len(self._data)
                if room <= 0:
                    await self._wait()
                    continue
                self._data += data[pos : pos + room]
                pos += room
                self._wake_all()
        finally:
            self._lock.release()

    async def read_into(self, buf: memoryview) -> int:
        self._lock.acquire()
        try:
            while not self._data:
                if self._closed:
                    return 0
                await self._wait()
            n = min(len(self._data), buf.nbytes)
            buf[:n] = self._data[:n]
            del self._data[:n]
            self._wake_all()
            return n
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake_all()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class MemoryStream(ByteStream):
    def __init__(self, inbound: _Pipe, outbound: _Pipe, peer: str) -> None:
        self._in = inbound
        self._out = outbound
        self.peer = peer
        self.last_active = time.monotonic()

    async def recv_into(self, buf: memoryview) -> int:
        got = await self._in.read_into(buf)
        self.last_active = time.monotonic()
        return got

    async def send(self, buffers: Sequence[Buffer]) -> None:
        for b in buffers:
            await self._out.write(memoryview(b).cast("B"))
            self.last_active = time.monotonic()

    async def close(self) -> None:
        self._in.close()
        self._out.close()


class MemoryListener(Listener):
    networked = False  # an in-process pipe: nothing outside this process reaches it

    def __init__(self, address: Address, handler: StreamHandler) -> None:
        self.address = address
        self._handler = handler
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._streams: set[MemoryStream] = set()

    def accept(self) -> MemoryStream:
        """Make a stream pair; serve the server end on the listener's own loop."""
        up, down = _Pipe(), _Pipe()
        server_end = MemoryStream(up, down, "memory://client")
        try:
            self._loop.call_soon_threadsafe(self._start, server_end)
        except RuntimeError as exc:  # the server's loop is closed: its server is gone
            raise ConnectError(f"the in-process server at {self.address} has stopped") from exc
        return MemoryStream(down, up, str(self.address))

    def _start(self, stream: MemoryStream) -> None:
        task = self._loop.create_task(self._serve(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, stream: MemoryStream) -> None:
        self._streams.add(stream)
        try:
            await self._handler(stream)
        finally:
            self._streams.discard(stream)
            await stream.close()

    async def close(self) -> None:
        with _registry_lock:
            if _listeners.get(self.address.host) is self:
                del _listeners[self.address.host]
        for stream in list(self._streams):
            await stream.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def connect(address: Address, timeout: float) -> MemoryStream:
    with _registry_lock:
        listener = _listeners.get(address.host)
    if listener is None:
        raise ConnectError(f"no in-process server is listening at {address}")
    return listener.accept()


async def listen(address: Address, handler: StreamHandler) -> MemoryListener:
    with _registry_lock:
        if address.host in _listeners:
            raise ConnectError(f"an in-process server already listens at {address}")
        listener = MemoryListener(address, handler)
        _listeners[address.host] = listener
    return listener
