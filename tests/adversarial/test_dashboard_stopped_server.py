"""A server's own page (``serve --dashboard-port``) reads the server's state on the server's event
loop. When that loop has closed (the server stopped before its page) or does not answer in time,
each snapshot is a row saying why, as for any server that is down: before, the page raised
``RuntimeError: Event loop is closed`` and logged it with its traceback every second for as long as
it lived, into whatever else the process printed (the parallel suite found it in a CLI's stderr)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from tensorwire import ServerThread
from tensorwire.dashboard import sources
from tensorwire.dashboard.collect import Node
from tensorwire.server.core import Server


async def _source(server: Server, timeout: float) -> Callable[[], Awaitable[list[Node]]]:
    return sources.local(server, timeout)  # made on the server's loop, as serve does


async def _asleep(seconds: float) -> None:
    time.sleep(seconds)  # blocks the loop it runs on, as a stuck serving loop would


def test_a_page_whose_server_stopped_shows_a_row_saying_so() -> None:
    with ServerThread() as srv:
        snapshot = srv._thread.call(_source(srv.server, 5.0), 30, "the page's source")
        url = srv.url
        assert asyncio.run(snapshot())[0].status is not None  # up: its STATUS
    (node,) = asyncio.run(snapshot())  # the server's loop is closed now
    assert node.url == url and node.status is None and node.error == "the server has stopped"


def test_a_page_whose_server_does_not_answer_shows_a_row_saying_so() -> None:
    with ServerThread() as srv:
        snapshot = srv._thread.call(_source(srv.server, 0.2), 30, "the page's source")
        blocked = srv._thread.submit(_asleep(1.5))
        (node,) = asyncio.run(snapshot())
        blocked.result(10)
    assert node.status is None and node.error is not None and "did not answer STATUS" in node.error
