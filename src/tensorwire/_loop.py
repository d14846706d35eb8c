"""Event loop choice: uvloop when it is installed (the ``fast`` extra), else asyncio's own."""

from __future__ import annotations

import asyncio
import os

NO_UVLOOP_ENV = "TENSORWIRE_NO_UVLOOP"


def new_event_loop() -> asyncio.AbstractEventLoop:
    if not os.environ.get(NO_UVLOOP_ENV):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()  # type: ignore[no-any-return]
    return asyncio.new_event_loop()


def run(coro: object) -> object:
    """``asyncio.run`` on the preferred loop."""
    return asyncio.run(coro, loop_factory=new_event_loop)  # type: ignore[arg-type]
