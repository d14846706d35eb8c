"""Waits that spin before they sleep on an event loop (transport/spin.py): an asyncio client's
wait for its answer (``busy_wait``) and a server's wait for a connection's next request
(``busy_poll``) keep their loop polling, with no blocking poll, while the bytes come soon. Real
servers on loopback; the loops are asyncio's own, whose selector shows each poll's timeout."""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import tensorwire
from tensorwire import _aio, cli
from tensorwire.server import Server, ServerThread
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.store import TensorStore
from tensorwire.store.memory import Entry
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

    def sleeps(self) -> int:
        """How many polls since the last call could have slept (a timeout other than 0)."""
        timeouts, self.timeouts = self.timeouts, []
        return sum(1 for t in timeouts if t is None or t > 0)


def _watch(loop: asyncio.AbstractEventLoop) -> _Selects:
    selects = _Selects(loop._selector)  # type: ignore[attr-defined]
    loop._selector = selects  # type: ignore[attr-defined]
    return selects


@pytest.fixture()
def asyncio_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loops made from now on are asyncio's own, not uvloop's (whose poll cannot be watched)."""
    monkeypatch.setenv(_aio.NO_UVLOOP_ENV, "1")


class _SlowStore(TensorStore):
    """A store whose reads take 2 ms: an answer that surely comes after its request's wait began."""

    def acquire(self, names: Sequence[str]) -> list[Entry]:
        time.sleep(0.002)  # the server's own work, on its thread, not a wait of the test's
        return super().acquire(names)


@pytest.fixture()
def slow_server(asyncio_loops: None) -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0"], store=_SlowStore(1 << 26)) as srv:
        yield srv


def _gets_that_slept(url: str, busy_wait: float) -> int:
    async def main() -> int:
        async with await tensorwire.aconnect(url, busy_wait=busy_wait) as c:
            await c.put("spin/x", torch.randn(256))
            selects = _watch(asyncio.get_running_loop())
            slept = 0
            for _ in range(20):
                selects.sleeps()
                await c.get("spin/x")
                slept += selects.sleeps() > 0
            return slept

    return asyncio.run(main())


def test_an_asyncio_clients_wait_spins_before_it_sleeps(slow_server: ServerThread) -> None:
    """Each answer comes 2 ms after its request: without a spin (nearly) every wait for one sleeps;
    with a 10 ms spin hardly any does (20 and 0 of 20 here). A spin needs a free CPU: on a machine
    busy with other work a spin runs out and the next ones sleep (11 of 20 in one loaded CI round),
    so the spinning client has three rounds to show it, as the busy-polling server below does."""
    assert _gets_that_slept(slow_server.url, 0.0) >= 15
    spun: list[int] = []
    while len(spun) < 3 and (not spun or spun[-1] > 8):
        spun.append(_gets_that_slept(slow_server.url, 0.01))
    assert spun[-1] <= 8, spun


def test_a_server_polls_for_the_next_request_with_busy_poll(asyncio_loops: None) -> None:
    """A client that sends a request 1 ms after each answer finds a server with ``busy_poll``
    awake: its loop did not sleep meanwhile; without it, it sleeps once in each of those gaps.
    A spin needs a free CPU: on a machine busy with other work (``make test``'s other workers) a
    round can find none, so the busy-polling server has three rounds to show it (20 and 0 sleeps
    here when the CPUs are free; 15 of 20 in one loaded round)."""
    assert _loop_sleeps(busy_poll=0.0) >= 15
    polled: list[int] = []
    while len(polled) < 3 and (not polled or polled[-1] > 8):
        polled.append(_loop_sleeps(busy_poll=0.01))
    assert polled[-1] <= 8, polled


def _loop_sleeps(busy_poll: float) -> int:
    """How many times a server's loop went to sleep over 20 gets, each 1 ms after the last answer."""
    with (
        ServerThread(
            ["tcp://127.0.0.1:0"],
            ServerOptions(connections=ConnectionOptions(busy_poll=busy_poll)),
            store=TensorStore(1 << 26),
        ) as srv,
        tensorwire.connect(srv.url, busy_wait=0.0) as c,
    ):
        c.put("spin/y", torch.randn(256))
        selects = _watch(srv._thread.loop)
        c.get("spin/y")
        selects.sleeps()  # what came before: the wait for this first request
        for _ in range(20):
            time.sleep(0.001)  # the client's own work between its requests
            c.get("spin/y")
        return selects.sleeps()  # and the wait after the last one, maybe


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
        Server(ServerOptions(connections=ConnectionOptions(busy_poll=1.0)))
    result = CliRunner().invoke(cli.main, ["serve", "--busy-poll", "1"])
    assert result.exit_code == 2 and "--busy-poll" in result.output
