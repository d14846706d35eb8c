"""A cancellation that lands in the same turn as a connect step's outcome is not lost: Python
3.11's ``asyncio.wait_for`` returned (or raised) the outcome instead, so a heartbeat loop cancelled
just as its TLS handshake failed beat on, and a ``Worker``'s close waited 20 s for it. Every
finite wait now goes through ``_aio.within`` (``make lint`` refuses ``asyncio.wait_for``)."""

from __future__ import annotations

import asyncio

import pytest

from tensorwire import _aio
from tensorwire.errors import ConnectError
from tensorwire.transport import tls


async def _cancelled_as_the_handshake_fails(monkeypatch: pytest.MonkeyPatch) -> asyncio.Task[None]:
    loop = asyncio.get_running_loop()
    answered = loop.create_future()

    async def handshake(self: tls.TlsStream) -> None:
        await answered  # the peer's answer arrives...
        raise ConnectError("the certificate does not verify")  # ...and fails the handshake

    monkeypatch.setattr(tls.TlsStream, "_handshake", handshake)
    stream = object.__new__(tls.TlsStream)
    stream.peer = "tls://test:1"
    task = loop.create_task(stream.handshake(5.0))
    await asyncio.sleep(0)  # the task waits for the answer
    answered.set_result(None)  # the answer and the cancellation in the same turn
    task.cancel()
    await asyncio.wait({task})  # its end, whichever it is, is read by the test
    return task


def test_a_cancellation_at_the_handshakes_failure_cancels(monkeypatch: pytest.MonkeyPatch) -> None:
    task = asyncio.run(_cancelled_as_the_handshake_fails(monkeypatch))
    assert task.cancelled(), task.exception()


async def _cancelled_as_its_wait_ends() -> asyncio.Task[str]:
    event = asyncio.Event()

    async def waiter() -> str:
        await _aio.within(event.wait(), 10)
        return "went on as if never cancelled"

    task = asyncio.get_running_loop().create_task(waiter())
    await asyncio.sleep(0)  # the task waits
    event.set()  # its wait ends and the cancellation lands in the same turn
    task.cancel()
    await asyncio.wait({task})
    return task


def test_within_keeps_a_cancellation_that_lands_as_its_wait_ends() -> None:
    task = _aio.run(_cancelled_as_its_wait_ends())  # uvloop where installed, as the clients run
    assert task.cancelled(), task.result()


def test_within_raises_timeouterror_when_its_time_is_up() -> None:
    async def never() -> None:
        await _aio.within(asyncio.Event().wait(), 0.01)

    with pytest.raises(TimeoutError):
        _aio.run(never())
