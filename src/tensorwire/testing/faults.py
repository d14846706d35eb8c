"""Fault injection for tests: declarative schedules of process and network faults.

A ``FaultSchedule`` is a list of ``Fault``s, each an action (kill -9, SIGSTOP, SIGCONT, drop a
connection, delay or corrupt the bytes through a proxy, partition a server off) and when to fire
it: after some seconds, or once a condition holds (polled, with a deadline). ``run`` fires them in
order on a thread; ``assert_fired`` then fails the test unless every fault really fired, so a
fault test cannot pass by never injecting its fault::

    proxy = FaultyProxy(server.url)               # clients connect to proxy.url
    schedule = FaultSchedule([
        Fault("drop connections", proxy.drop, when=lambda: stats()["step"] >= 5),
        Fault("kill -9 server", kill9(server.proc), after=2.0),
    ])
    with schedule.running():
        train(...)
    schedule.assert_fired()

Network faults go through ``FaultyProxy``, a TCP relay on loopback between clients and one
server: ``drop`` closes every relayed connection (both ends see a reset), ``delay`` holds every
chunk for some seconds, ``corrupt`` flips one byte of the next chunk towards the server,
``partition`` drops every connection and refuses new ones until ``heal``. ``silent_listener``
is a server that is there and never answers (a stopped or wedged process, as a connection sees it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tensorwire._aio import LoopThread
from tensorwire.types import Address


@dataclass
class Fault:
    """One fault: ``action`` fires ``after`` seconds from the schedule's start, or when ``when()``
    first holds (polled every 10 ms), whichever is given; ``fired_at`` records when it did."""

    name: str
    action: Callable[[], object]
    after: float = 0.0
    when: Callable[[], bool] | None = None
    fired_at: float | None = None
    error: BaseException | None = None


@dataclass
class FaultSchedule:
    faults: list[Fault]
    deadline: float = 120.0  # for each fault's trigger
    started: float = field(default=0.0, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tensorwire-faults", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @contextlib.contextmanager
    def running(self) -> Iterator[FaultSchedule]:
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def wait(self, timeout: float) -> None:
        """Wait until every fault fired (or failed); TimeoutError naming the ones that did not."""
        if self._thread is not None:
            self._thread.join(timeout)
        pending = [f.name for f in self.faults if f.fired_at is None and f.error is None]
        if pending:
            raise TimeoutError(f"waited {timeout}s for the faults {pending} to fire")

    def assert_fired(self) -> None:
        """Fail unless every fault fired without an error."""
        for fault in self.faults:
            if fault.error is not None:
                raise AssertionError(f"fault {fault.name!r} failed to fire: {fault.error!r}")
            if fault.fired_at is None:
                raise AssertionError(f"fault {fault.name!r} never fired")

    def _run(self) -> None:
        for fault in self.faults:
            if not self._trigger(fault):
                return
            try:
                fault.action()
                fault.fired_at = time.monotonic() - self.started
            except BaseException as exc:
                fault.error = exc

    def _trigger(self, fault: Fault) -> bool:
        limit = time.monotonic() + self.deadline
        due = self.started + fault.after
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= due and (fault.when is None or fault.when()):
                return True
            if now > limit:
                fault.error = TimeoutError(
                    f"the trigger of {fault.name!r} did not hold within {self.deadline}s"
                )
                return False
            self._stop.wait(0.01)
        return False


# -- process faults --------------------------------------------------------------------------------
def kill9(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    return lambda: _signal(proc, signal.SIGKILL)


def sigstop(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    return lambda: _signal(proc, signal.SIGSTOP)


def sigcont(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    return lambda: _signal(proc, signal.SIGCONT)


@contextlib.contextmanager
def silent_listener() -> Iterator[socket.socket]:
    """A loopback socket that listens and never accepts: the kernel completes each TCP handshake
    from its backlog and nothing ever answers, as with a stopped (SIGSTOP) or wedged server.
    Non-blocking: ``accept()`` raises BlockingIOError unless someone connected."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        sock.setblocking(False)
        yield sock


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is not None:
        raise ProcessLookupError(f"process {proc.pid} already exited with {proc.returncode}")
    os.kill(proc.pid, sig)


# -- network faults --------------------------------------------------------------------------------
class FaultyProxy:
    """A TCP relay from ``url`` to one server's ``tcp://`` address, with faults on demand."""

    def __init__(self, target: str) -> None:
        self.target = Address.parse(target)
        self._thread = LoopThread("tensorwire-proxy")
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._delay = 0.0
        self._corrupt_next = False
        self._partitioned = False
        self._flowing: asyncio.Event | None = None  # cleared while paused (made on the proxy's loop)
        self.held = 0  # chunks waiting for ``resume`` right now
        self.dropped = self.corrupted = 0
        self.bytes_up = 0  # bytes relayed towards the server
        self._server: asyncio.Server = self._thread.call(self._listen(), 10, "the proxy to listen")
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"tcp://127.0.0.1:{port}"

    def drop(self) -> None:
        """Close every relayed connection now."""
        self._thread.call(self._drop(), 10, "the proxy to drop its connections")

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    def pause(self) -> None:
        """Hold every byte in both directions (connections stay open) until ``resume``: a link
        that stalls, deterministically, where ``delay`` only slows each chunk."""
        self._thread.call(self._set_flowing(False), 10, "the proxy to pause")

    def resume(self) -> None:
        self._thread.call(self._set_flowing(True), 10, "the proxy to resume")

    def corrupt(self) -> None:
        """Flip one byte of the next chunk a client sends."""
        self._corrupt_next = True

    def partition(self) -> None:
        """Drop every connection and refuse new ones, until ``heal``."""
        self._partitioned = True
        self.drop()

    def heal(self) -> None:
        self._partitioned = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._thread.call(self._close(), 10, "the proxy to close")
        self._thread.stop()

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._relay, "127.0.0.1", 0)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._partitioned:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target.host, self.target.port)
        except OSError:
            writer.close()
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer, True), self._pipe(up_reader, writer, False))
        finally:
            self._pairs.discard(pair)
            for w in pair:
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await reader.read(1 << 16):
                if self._delay:
                    await asyncio.sleep(self._delay)
                if self._flowing is not None and not self._flowing.is_set():
                    self.held += 1
                    try:
                        await self._flowing.wait()
                    finally:
                        self.held -= 1
                if upstream and self._corrupt_next and len(chunk) > 64:
                    self._corrupt_next = False
                    self.corrupted += 1
                    index = len(chunk) // 2  # past the frame header: a data byte, most likely
                    chunk = chunk[:index] + bytes([chunk[index] ^ 0xFF]) + chunk[index + 1 :]
                if upstream:
                    self.bytes_up += len(chunk)
                writer.write(chunk)
                await writer.drain()
        writer.close()

    async def _set_flowing(self, flowing: bool) -> None:
        if self._flowing is None:
            self._flowing = asyncio.Event()
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _drop(self) -> None:
        for pair in list(self._pairs):
            for w in pair:
                w.transport.abort()
            self.dropped += 1

    async def _close(self) -> None:
        self._server.close()
        await self._drop()
        await self._server.wait_closed()
