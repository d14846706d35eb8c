"""Event loop choice: uvloop when it is installed (the ``fast`` extra), else asyncio's own."""

from __future__ import annotations

import asyncio
import os
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
