"""broadcast/pipeline.py: several single-chunk requests in flight, a chunk counted as soon as it and
every chunk before it are in, and a failure resumed from the lowest chunk not verified."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from tensorwire.broadcast import pipeline
from tensorwire.errors import CorruptFrame

Fetch = Callable[[int], Coroutine[Any, Any, None]]


def _run(fetch: Fetch, pulled: pipeline.Pulled, window: int, seen: list[int], deadline: float = 30.0) -> bool:
    async def advanced(verified: int) -> None:
        seen.append(verified)

    return asyncio.run(pipeline.pull(fetch, pulled, window, time.monotonic() + deadline, advanced))


def test_pulled_counts_only_the_unbroken_prefix() -> None:
    pulled = pipeline.Pulled(5)
    for chunk in (1, 2, 4):
        pulled.land(chunk)
    assert pulled.verified == 0 and pulled.missing() == [0, 3]
    pulled.land(0)
    assert pulled.verified == 3 and pulled.missing() == [3]
    pulled.land(3)
    assert pulled.complete and pulled.missing() == []


def test_window_requests_in_flight_and_each_chunk_counted_as_it_lands() -> None:
    inflight, most, fetched = [0], [0], []

    async def fetch(chunk: int) -> None:
        inflight[0] += 1
        most[0] = max(most[0], inflight[0])
        await asyncio.sleep(0.001 * (chunk % 3))  # answers land out of order
        fetched.append(chunk)
        inflight[0] -= 1

    seen: list[int] = []
    assert _run(fetch, pipeline.Pulled(20), 4, seen)
    assert most[0] == 4 and sorted(fetched) == list(range(20))
    assert seen == sorted(seen) and seen[-1] == 20 and len(seen) > 1


def test_a_failure_resumes_from_the_lowest_chunk_not_verified() -> None:
    pulled, seen, landed = pipeline.Pulled(10), [], []
    others = asyncio.Event()

    async def bad(chunk: int) -> None:
        if chunk == 3:  # fails last: every chunk after it lands (and is kept) first
            await others.wait()
            raise CorruptFrame("chunk 3 does not match")
        landed.append(chunk)
        if len(landed) == 9:
            others.set()

    with pytest.raises(CorruptFrame):
        _run(bad, pulled, 4, seen)
    assert pulled.verified == 3 and pulled.missing() == [3] and seen[-1] == 3
    again: list[int] = []

    async def good(chunk: int) -> None:
        again.append(chunk)

    assert _run(good, pulled, 4, seen)
    assert again == [3] and pulled.complete and seen[-1] == 10


def test_a_passed_deadline_returns_false_and_abandons_the_requests() -> None:
    cancelled: list[int] = []

    async def stuck(chunk: int) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(chunk)
            raise

    assert not _run(stuck, pipeline.Pulled(8), 2, [], deadline=0.05)
    assert sorted(cancelled) == [0, 1]
