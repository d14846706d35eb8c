"""Asyncio plumbing shared by every layer: the event loop (uvloop when it is installed, the
``fast`` extra), a loop on a thread under the blocking APIs, and finite waits whose errors name
what was waited for."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from tensorwire.errors import TransferTimeout

T = TypeVar("T")

NO_UVLOOP_ENV = "TENSORWIRE_NO_UVLOOP"


def new_event_loop() -> asyncio.AbstractEventLoop:
    if not os.environ.get(NO_UVLOOP_ENV):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the preferred loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)


class LoopThread:
    """An event loop running on a daemon thread: the engine under the blocking APIs (``Client``,
    ``ps.Worker``). ``submit`` schedules a coroutine; ``call`` also waits for it, boundedly."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop is closed (a client closed under a call from another thread)
            coro.close()
            raise

    def call(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """Run ``coro`` on the loop and wait for it; TransferTimeout naming ``what`` after ``timeout``
        (a backstop: the coroutine's own timers should fire first)."""
        return wait(self.submit(coro), timeout, what)

    def on_loop(self) -> bool:
        """Whether the caller runs on this loop's own thread (where ``call`` would wait for itself)."""
        return threading.current_thread() is self._thread

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


def wait(future: concurrent.futures.Future[T], timeout: float, what: str) -> T:
    try:
        return future.result(timeout=timeout)
    except TimeoutError as exc:
        if future.done():  # the coroutine's own timeout error
            raise
        future.cancel()
        raise TransferTimeout(f"waited {timeout:.3g}s for {what}") from exc


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """``await aw``, TimeoutError after ``seconds`` (None: no limit): ``asyncio.wait_for`` without
    its flaw on Python 3.11, where a cancellation that lands in the turn ``aw`` ends in is lost and
    the caller goes on as if never cancelled (a loop meant to stop keeps running; a close waits on
    it). ``make lint`` refuses ``asyncio.wait_for``."""
    async with asyncio.timeout(seconds):
        return await aw


@contextlib.asynccontextmanager
async def asyncio_timeout(seconds: float, what: str) -> AsyncIterator[None]:
    """Like ``asyncio.timeout`` but raises TransferTimeout("waited Ns for <what>")."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as exc:
        if isinstance(exc, TransferTimeout):
            raise
        raise TransferTimeout(f"waited {seconds:.3g}s for {what}") from exc


@dataclass(frozen=True, slots=True)
class Deadline:
    """The moment a whole command gives up (``dataset fetch --deadline``, ``status``): per-request
    timeouts alone let a peer that answers each request just in time hold a command for ever."""

    at: float  # time.monotonic()
    what: str  # what gives up, and which flag sets it: "dataset fetch (--deadline 3600s)"

    @classmethod
    def after(cls, seconds: float, what: str) -> Deadline:
        return cls(time.monotonic() + seconds, what)

    def remaining(self) -> float:
        return max(self.at - time.monotonic(), 0.0)

    def expired(self) -> TransferTimeout:
        return TransferTimeout(f"{self.what} ran out of time")

    def check(self) -> None:
        """TransferTimeout if the deadline has passed."""
        if time.monotonic() >= self.at:
            raise self.expired()


class WouldWait(RuntimeError):
    """``drive``: the coroutine waited on an event loop, which a thread that runs it alone cannot."""


def drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end in this thread, with no event loop: for coroutines that only ever
    give the loop a turn (``asyncio.sleep(0)``, a bare yield) and never wait on a future, such as
    frame I/O on a stream whose waits block (``tcp.LentTcp``). One that waits is closed (its
    ``finally`` blocks run) and ``WouldWait`` raised."""
    try:
        while coro.send(None) is None:
            pass  # a turn given to nobody
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise WouldWait("a call run outside the event loop had to wait on it")


def hold_now(lock: asyncio.Lock) -> bool:
    """Take ``lock`` without waiting, from code that cannot (a loop's callback): False, and
    nothing taken, when another task holds it or waits for it (their turn comes first)."""
    if lock.locked():
        return False
    acquire = lock.acquire()
    try:
        acquire.send(None)
    except StopIteration:
        return True
    acquire.close()  # it queued behind a waiter: withdraw (its own clean-up runs)
    return False


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Stop a background task (a watchdog, a ping loop) and wait until it has: its own
    cancellation is the expected end, not an error. ``None``: nothing to stop."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
