"""Pulling a generation's chunks from one upstream with several single-chunk requests in flight.

Why single chunks: a hop can forward a chunk only once it is verified, and a chunk is verified
only once the answer it came in has landed. An answer of several chunks makes every hop lag its
upstream by that whole answer; one chunk per answer makes the lag one chunk. Why several in
flight: one request at a time leaves the link idle for a round trip between answers (the head of
a chain, reading from the origin, would crawl). The requests share one connection (the transport
matches answers to requests by id) and the upstream answers them in order, each as soon as it has
the chunk.

Lifecycle: the caller makes one ``Pulled`` per generation and calls ``pull`` with a ``fetch`` for
the current upstream; ``pull`` returns when every chunk is verified (True) or the deadline passed
(False), and raises the first failure of a request once the others in flight are abandoned (their
connection goes with them). ``Pulled`` keeps what was verified, so the caller can call ``pull``
again with another upstream: it goes on from the lowest chunk not verified yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Pulled:
    """Which of a generation's ``chunks`` are in memory and verified."""

    chunks: int
    verified: int = 0  # chunks 0 .. verified-1 are all verified: what a hop may forward
    ahead: set[int] = field(default_factory=set)  # verified chunks past ``verified``

    @property
    def complete(self) -> bool:
        return self.verified >= self.chunks

    def land(self, chunk: int) -> None:
        self.ahead.add(chunk)
        while self.verified in self.ahead:
            self.ahead.remove(self.verified)
            self.verified += 1

    def missing(self) -> list[int]:
        """The chunks still to pull, lowest first."""
        return [k for k in range(self.verified, self.chunks) if k not in self.ahead]


async def pull(
    fetch: Callable[[int], Coroutine[Any, Any, None]],
    pulled: Pulled,
    window: int,
    deadline: float,
    advanced: Callable[[int], Awaitable[None]],
) -> bool:
    """Pull ``pulled``'s missing chunks with ``fetch(chunk)`` (it lands and verifies one chunk, or
    raises), at most ``window`` in flight; ``advanced(verified)`` hears each time ``verified``
    grows. True once all are verified, False if ``deadline`` (``time.monotonic()``) came first."""
    todo = iter(pulled.missing())
    inflight: dict[asyncio.Task[None], int] = {}
    try:
        while not pulled.complete:
            while len(inflight) < window and (chunk := next(todo, None)) is not None:
                inflight[asyncio.create_task(fetch(chunk))] = chunk
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            done, _ = await asyncio.wait(inflight, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            before = pulled.verified
            _settle(done, inflight, pulled)
            if pulled.verified > before:
                await advanced(pulled.verified)
        return True
    finally:
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)


def _settle(done: set[asyncio.Task[None]], inflight: dict[asyncio.Task[None], int], pulled: Pulled) -> None:
    """Count the chunks whose requests succeeded, then raise the failure of the lowest that did not
    (the others still in flight are abandoned by ``pull``)."""
    failed: list[tuple[int, BaseException]] = []
    for task in done:
        chunk = inflight.pop(task)
        error = task.exception()
        if error is None:
            pulled.land(chunk)
        else:
            failed.append((chunk, error))
    if failed:
        raise min(failed, key=lambda item: item[0])[1]
