"""Event loop choice: uvloop when it is installed (the ``fast`` extra), else asyncio's own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

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
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

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
    from tensorwire.errors import TransferTimeout

    try:
        return future.result(timeout=timeout)
    except TimeoutError as exc:
        if future.done():  # the coroutine's own timeout error
            raise
        future.cancel()
        raise TransferTimeout(f"waited {timeout:.3g}s for {what}") from exc
