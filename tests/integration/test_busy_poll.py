"""Waits that spin before they sleep on an event loop (transport/spin.py): an asyncio client's
wait for its answer (``busy_wait``) and a server's wait for a connection's next request
(``busy_poll``) keep their loop polling, with no blocking poll, while the bytes come soon. Real
servers on loopback; the loops are asyncio's own, whose selector shows each poll's timeout."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import tensorwire
from tensorwire import _aio, cli
from tensorwire.server import Server, ServerThread
from tensorwire.store import TensorStore
from tensorwire.transport.spin import Spin


class _Selects:
    """Stands in for a loop's selector, keeping the timeout of every poll it makes."""

    def __init__(self, real: selectors.BaseSelector) -> None:
        self.real = real
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        return self.real.select(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def slept(self) -> bool:
        """Whether a poll since the last call could have slept (a timeout other than 0)."""
        slept = any(t is None or t > 0 for t in self.timeouts)
        self.timeouts.clear()
        return slept


def _watch(loop: asyncio.AbstractEventLoop) -> _Selects:
    selects = _Selects(loop._selector)  # type: ignore[attr-defined]
    loop._selector = selects  # type: ignore[attr-defined]
    return selects


@pytest.fixture()
def asyncio_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loops made from now on are asyncio's own, not uvloop's (whose poll cannot be watched)."""
    monkeypatch.setenv(_aio.NO_UVLOOP_ENV, "1")


@pytest.fixture()
def server(asyncio_loops: None) -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0"], store=TensorStore(1 << 26)) as srv:
        yield srv


def _gets_that_slept(url: str, busy_wait: float) -> list[bool]:
    async def main() -> list[bool]:
        async with await tensorwire.aconnect(url, busy_wait=busy_wait) as c:
            await c.put("spin/x", torch.randn(256))
            selects = _watch(asyncio.get_running_loop())
            slept = []
            for _ in range(20):
                selects.slept()
                await c.get("spin/x")
                slept.append(selects.slept())
            return slept

    return asyncio.run(main())


def test_an_asyncio_clients_wait_spins_before_it_sleeps(server: ServerThread) -> None:
    never = sum(_gets_that_slept(server.url, 0.0))  # most waits sleep (16-20 of 20 here) ...
    spinning = sum(_gets_that_slept(server.url, 0.01))  # ... and with a spin, hardly any (0 here)
    assert spinning <= 5 and spinning < never, (never, spinning)


def test_a_server_polls_for_the_next_request_with_busy_poll(asyncio_loops: None) -> None:
    """A client that sends request after request finds a server with ``busy_poll`` awake: its
    loop did not sleep between them; without it, it sleeps before most (17-19 of 19 here)."""
    slept = {}
    for busy_poll in (0.0, 0.01):
        store = TensorStore(1 << 26)
        with (
            ServerThread(["tcp://127.0.0.1:0"], store=store, busy_poll=busy_poll) as srv,
            tensorwire.connect(srv.url, busy_wait=0.0) as c,
        ):
            c.put("spin/y", torch.randn(256))
            selects = _watch(srv._thread.loop)
            slept[busy_poll] = 0
            for i in range(20):
                c.get("spin/y")
                slept[busy_poll] += selects.slept() and i > 0  # the first waited for the put's end
    assert slept[0.01] <= 5 and slept[0.01] < slept[0.0], slept


def test_spins_that_run_out_are_skipped_for_longer_each_time() -> None:
    spin = Spin(1e-4)
    pattern = []
    for _ in range(12):
        spun = spin.pays()
        pattern.append(spun)
        if spun:
            spin.ended(caught=False)  # an answer that keeps taking longer than the spin
    assert pattern == [True, False, True, False, False, False, True, False, False, False, False, False]
    while not spin.pays():
        pass
    spin.ended(caught=True)  # one that came in time: the next wait spins again
    assert spin.pays()
    assert not Spin(0.0).pays()


def test_a_spin_is_not_a_way_to_wait() -> None:
    with pytest.raises(ValueError, match="busy_poll"):
        Server(busy_poll=1.0)
    result = CliRunner().invoke(cli.main, ["serve", "--busy-poll", "1"])
    assert result.exit_code == 2 and "--busy-poll" in result.output
