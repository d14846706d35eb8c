"""The benchmarks' child processes (servers and peers) and the CPUs they run on.

Lifecycle of a child: the parent makes a ``Child(target, *args)`` (spawned: fork would copy the
parent's threads and torch state), usually inside ``with spawned() as children``; the child runs
``target(conn, *args)``, starts what it serves inside ``with starting(conn)`` and sends
``("ready", value)``, or the failure's traceback as ``("error", text)``; the parent's
``Child.ready()`` returns the value. The child then serves until the parent sends anything or
closes the pipe (``wait_for_stop``, ``until_stopped`` on an event loop, or the whole sequence in
``serve_until_stopped``), or answers requests (``Child.tell``, then ``Child.answer``; the child's
side is ``serve_requests``) until then; ``Child.reap`` (or leaving ``spawned()``) stops it, then
terminates and kills it if it does not exit in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

Cpus = frozenset[int] | None  # a CPU set to pin a process to, or None to leave it to the scheduler

START_TIMEOUT = 120.0  # a child imports torch first; generous for a loaded 2-core machine
STOP_TIMEOUT = 10.0
STOP = "stop"  # what ``Child.stop`` sends


class Child:
    """A spawned helper process and the pipe it reports on (the module docstring has its lifecycle)."""

    def __init__(self, target: Callable[..., None], *args: object, cpus: Cpus = None) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork would copy the parent's threads and torch state
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_entry, args=(target, child_conn, cpus, *args), name=target.__name__, daemon=True
        )
        try:
            self._proc.start()
        finally:
            child_conn.close()  # only the child's copy may stay open, or the child never sees EOF

    @property
    def pid(self) -> int:
        """The child's process id (to measure its CPU time and memory)."""
        assert self._proc.pid is not None
        return self._proc.pid

    def ready(self, timeout: float = START_TIMEOUT) -> object:
        """What the child sent with "ready"; raises if it failed, died or took too long."""
        return self._receive("ready", timeout, "start")

    def tell(self, request: object) -> None:
        """Send a request to a child that serves them (``serve_requests``); ``answer`` waits for
        what it answers. Telling several children first, then collecting, runs them together."""
        self._conn.send(request)

    def answer(self, timeout: float) -> object:
        """The child's answer to the last ``tell``; raises if it failed, died or took too long."""
        return self._receive("ok", timeout, "answer")

    def _receive(self, expected: str, timeout: float, what: str) -> object:
        # Waiting on the sentinel too means a crashed child is noticed at once, not at the timeout.
        if not multiprocessing.connection.wait([self._conn, self._proc.sentinel], timeout):
            raise TimeoutError(f"{self._proc.name} did not {what} within {timeout:.0f}s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._proc.join(STOP_TIMEOUT)
            raise RuntimeError(f"{self._proc.name} exited with code {self._proc.exitcode}") from None
        if kind != expected:
            raise RuntimeError(f"{self._proc.name} failed:\n{value}")
        return value

    def stop(self) -> None:
        """Ask the child to stop; ``reap`` waits for it."""
        if not self._conn.closed:
            with contextlib.suppress(OSError):
                self._conn.send(STOP)
            self._conn.close()

    def reap(self) -> None:
        """Make sure the child is gone: wait, then terminate, then kill."""
        self.stop()
        self._proc.join(STOP_TIMEOUT)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(STOP_TIMEOUT)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(STOP_TIMEOUT)
        self._proc.close()


def _child_entry(target: Callable[..., None], conn: Connection, cpus: Cpus, *args: object) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # after the imports, so that the children import in parallel
    target(conn, *args)
    # A child that ended cleanly holds nothing worth tearing down, and the interpreter's teardown
    # with torch loaded takes ~0.4 s per process: skip it (a failure still exits the normal way).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def close_all(children: list[Child]) -> None:
    # Signal every child before waiting for any, so that they wind down in parallel.
    for child in children:
        child.stop()
    for child in children:
        child.reap()


@contextlib.contextmanager
def spawned() -> Iterator[list[Child]]:
    """A list to append children to; on leaving, error or not, every one of them is gone."""
    children: list[Child] = []
    try:
        yield children
    finally:
        close_all(children)


# -- the child's side ------------------------------------------------------------------------------
@contextlib.contextmanager
def starting(conn: Connection) -> Iterator[None]:
    """Around a child's start: a failure is sent to the parent (it waits on the pipe, not on
    stderr) as ``("error", traceback)``, then raised."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise


def wait_for_stop(conn: Connection) -> None:
    """Block until the parent sends anything or closes the pipe."""
    multiprocessing.connection.wait([conn])


async def until_stopped(conn: Connection) -> None:
    """Return once the parent sends anything or closes the pipe, without blocking the loop."""
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not stopped.done():
            stopped.set_result(None)

    loop.add_reader(conn.fileno(), readable)
    try:
        await stopped
    finally:
        loop.remove_reader(conn.fileno())


def serve_requests(conn: Connection, handle: Callable[[object], object]) -> None:
    """After "ready": answer each request the parent ``tell``s with ``("ok", handle(request))``, or
    ``("error", traceback)`` if it raised, until the parent stops the child or closes the pipe."""
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request == STOP:
            return
        try:
            answer: tuple[str, object] = ("ok", handle(request))
        except Exception:
            answer = ("error", traceback.format_exc())
        try:
            conn.send(answer)
        except OSError:  # the parent is gone (it gave up on another child): nobody to answer
            return


def serve_until_stopped(conn: Connection, start: Callable[[], tuple[object, Callable[[], object]]]) -> None:
    """A child's whole life for a blocking server: ``start()`` returns what to report as ready (its
    port) and how to stop it; serve until the parent says stop, then stop it."""
    with starting(conn):
        value, stop = start()
        conn.send(("ready", value))
    try:
        wait_for_stop(conn)
    finally:
        stop()


def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from a blocking socket; False when the sender closed the connection (between
    or during transfers)."""
    filled = 0
    while filled < view.nbytes:
        got = sock.recv_into(view[filled:])
        if got == 0:
            return False
        filled += got
    return True


# -- placement -------------------------------------------------------------------------------------
PIN_HELP = "do not pin client and servers to separate CPUs"


def add_run_options(parser: argparse.ArgumentParser, pin_help: str = PIN_HELP) -> None:
    """``--json`` (``report.show``) and ``--no-pin`` (``args.pin``, for ``placement``): the options
    every benchmark that places its children takes."""
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help=pin_help)


def placement(pin: bool) -> tuple[Cpus, Cpus]:
    """(client CPUs, server CPUs): one CPU each when pinning is asked for and possible."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return frozenset(cpus[:1]), frozenset(cpus[1:2])


@contextlib.contextmanager
def pinned(cpus: Cpus) -> Iterator[None]:
    """Pin the calling thread (and the threads it starts, like a Client's loop) while inside."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)  # main() may run inside a test process or the CLI


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, its threads included."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)
