"""The blocking client's plain gets and puts made in the caller's own thread, on a connection its
loop lent (client/inline.py, transport/lending.py): real servers on loopback, a real server
process stopped with a real signal."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire import errors
from tensorwire.client import Client
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.testing.process import ServerProcess, run_threads, wait_for
from tensorwire.transport.ranged import RangedTransport
from tensorwire.transport.tcp import LentTcp


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0"], store=TensorStore(1 << 30)) as srv:
        yield srv


def _transport(client: Client) -> RangedTransport:
    t = client._async.current_transport
    assert isinstance(t, RangedTransport), t
    return t


def _lent(client: Client) -> bool:
    return _transport(client)._lending.loan is not None


class _LoopCalls:
    """Counts the calls a client makes through its event-loop thread."""

    def __init__(self, client: Client) -> None:
        self.count = 0
        self._call = client._thread.call
        client._thread.call = self  # type: ignore[method-assign]

    def __call__(self, *args: Any) -> Any:
        self.count += 1
        return self._call(*args)


def test_plain_gets_and_puts_run_in_the_callers_thread(server: ServerThread) -> None:
    with tensorwire.connect(server.url) as c:
        x = torch.randn(1000)
        first = c.put("inline/x", x)  # through the loop, which lends the connection after it
        assert _lent(c)
        loop = _LoopCalls(c)
        out = torch.empty(1000)
        for i in range(1, 21):
            assert c.get("inline/x", out=out) is out and torch.equal(out, x)
            assert c.put("inline/x", x + i) == first + i  # versions go on as on the loop
            x = x + i
        assert torch.equal(c.get("inline/x"), x)  # a new tensor, and a non-contiguous out
        strided = torch.empty(2000)[::2]
        assert torch.equal(c.get("inline/x", out=strided), x)
        assert loop.count == 0, "a plain call went through the loop"
        assert c.stat("inline/x").version == first + 20  # a STAT goes through the loop ...
        assert loop.count == 1 and not _lent(c)  # ... which took the connection back first
        c.get("inline/x", out=out)  # one through the loop lends it again
        assert _lent(c)


class _Polls:
    """Stands in for a lent stream's poll object, keeping the timeout of every poll(2) it makes."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.timeouts: list[int] = []

    def register(self, fd: int, events: int) -> None:
        self.real.register(fd, events)

    def poll(self, timeout: int) -> list[tuple[int, int]]:
        self.timeouts.append(timeout)
        return self.real.poll(timeout)  # type: ignore[no-any-return]


def _sleeps_per_get(busy_wait: float, url: str) -> list[bool]:
    """For each of 20 inline gets, whether its thread slept in poll(2) (a poll with a timeout)."""
    with tensorwire.connect(url, busy_wait=busy_wait) as c:
        c.put("inline/spin", torch.randn(1000))  # through the loop, which lends the connection
        loan = _transport(c)._lending.loan
        assert loan is not None
        polls = loan.stream._poll = _Polls(loan.stream._poll)  # type: ignore[attr-defined]
        slept = []
        for _ in range(20):
            polls.timeouts.clear()
            c.get("inline/spin")
            slept.append(any(t > 0 for t in polls.timeouts))
        assert _transport(c)._lending.loan is loan  # every get was inline, on the same loan
        return slept


def test_an_inline_wait_spins_before_it_sleeps(server: ServerThread) -> None:
    """A thread asleep in poll(2) wakes late on a VM (its idle CPU halts), later than a small
    answer takes: a borrower polls without sleeping for up to ``busy_wait`` first."""
    assert all(_sleeps_per_get(0.0, server.url))  # never spinning, every wait sleeps
    assert not all(_sleeps_per_get(0.01, server.url))  # a loopback answer within 10 ms, mostly
    with pytest.raises(ValueError, match="busy_wait"):
        tensorwire.connect(server.url, busy_wait=1.0)  # a spin is not a way to wait


def test_what_cannot_go_inline_goes_through_the_loop(server: ServerThread) -> None:
    with tensorwire.connect(server.url) as c:
        c.put("inline/p", torch.ones(10))
        loop = _LoopCalls(c)
        seen: list[int] = []
        c.get("inline/p", progress=seen.append)  # a progress callback: the loop's path
        assert loop.count == 1 and seen == [40]
        c.get_many(["inline/p"])
        assert loop.count == 2
    with tensorwire.connect(server.url, cache_bytes=1 << 20) as cached:
        loop = _LoopCalls(cached)
        cached.get("inline/p")
        cached.get("inline/p")  # with a cache every get checks it: never inline
        assert loop.count == 2


def test_refusals_inline_keep_the_connection(server: ServerThread) -> None:
    with tensorwire.connect(server.url) as c:
        c.put("inline/r", torch.zeros(4))
        t = _transport(c)
        with pytest.raises(errors.KeyNotFound):
            c.get("inline/none")
        with pytest.raises(errors.InvalidTensor):
            c.get("inline/r", out=torch.empty(5))  # the wrong shape: refused, nothing kept
        with pytest.raises(errors.InvalidName):
            c.put("bad name\n", torch.zeros(1))
        assert _transport(c) is t and _lent(c) and not t.closed
        assert torch.equal(c.get("inline/r"), torch.zeros(4))


def test_threads_share_one_client(server: ServerThread) -> None:
    """Several threads on one client: one borrows the connection at a time, the others go through
    the loop, which takes it back and lends it again; every answer lands where it was asked for."""
    with tensorwire.connect(server.url) as c:

        def work(i: int) -> None:
            mine = torch.full((256,), float(i))
            out = torch.empty(256)
            for k in range(150):
                c.put(f"inline/t{i}", mine + k)
                assert torch.equal(c.get(f"inline/t{i}", out=out), mine + k)
                if k % 25 == 0:
                    assert c.stat(f"inline/t{i}").nbytes == 1024

        run_threads(work, 4, timeout=120)
        assert len(c.list("inline/t")) == 4


def test_a_request_waiting_for_a_borrower_takes_back_the_loan_lent_since(server: ServerThread) -> None:
    """A request on the loop waits for a borrower mid-call; meanwhile another request takes the
    connection back and the loop lends it anew. The first must end the new loan too: it once saw
    its own loan gone and went on to read the lent stream beside the next borrower (in CI:
    "concurrent poll() invocation")."""
    with tensorwire.connect(server.url) as c:
        c.put("inline/l", torch.ones(4))  # through the loop, which lends the connection
        t = _transport(c)
        mid_call, finish = threading.Event(), threading.Event()

        async def held(_: RangedTransport) -> None:
            mid_call.set()
            finish.wait(10)

        borrower = threading.Thread(target=t.run_inline, args=(held, 10.0))
        borrower.start()
        assert mid_call.wait(10)

        async def race() -> None:
            waiting = asyncio.ensure_future(t.reclaim())  # finds the borrower mid-call
            await asyncio.sleep(0)  # its first try at the loan's lock has failed
            finish.set()
            borrower.join(10)  # on the loop, so the waiting reclaim cannot run meanwhile
            await t.reclaim()  # another request takes the connection back ...
            assert t.lend()  # ... and, done, lends it again
            await waiting
            assert t._lending.loan is None, "a reclaim left the connection lent"

        c._thread.call(race(), 10, "the race")
        assert not borrower.is_alive()
        assert torch.equal(c.get("inline/l"), torch.ones(4))


def _waits_on_the_loop(loop: asyncio.AbstractEventLoop) -> Any:
    """A lent stream's coroutine read that awaits a future of the client's loop instead of
    blocking its thread: what an asyncio lock, an executor or a sleep on the inline path would do.
    A small answer is read with plain calls (``read_frame_now``), a large one by the multiplexer's
    coroutines, stepped by ``drive``: ``BIG``'s get reaches this."""

    async def recv_into(self: LentTcp, buf: memoryview) -> int:
        await asyncio.Future(loop=loop)  # settled by nobody: only the loop's thread could
        return 0

    return recv_into


BIG = 1 << 18  # float32s: 1 MiB, past the read buffer


def _in_a_thread(call: Any) -> BaseException | object:
    """``call()`` in a thread of its own, joined within 10 s: a path that hangs fails the test
    instead of hanging the suite."""
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert outcome, "an inline call that waited on the loop hung"
    return outcome[0]


def test_an_inline_call_that_waits_on_the_loop_fails_by_name(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The inline path's invariant (client/inline.py): nothing on it may wait on the event loop.
    A call that does anyway is stopped there (``_aio.drive``), neither hung nor left reading a
    stream out of step: with no retries it fails with ConnectionLost naming it, a warning says
    so, and its connection is dropped. (Remove the guard, in ``drive`` or in ``run_inline``, and
    this fails.)"""
    with tensorwire.connect(server.url, retries=0) as c:
        c.put("inline/w", torch.ones(BIG))  # through the loop, which lends the connection after it
        lent = _transport(c)
        assert _lent(c)
        monkeypatch.setattr(LentTcp, "recv_into", _waits_on_the_loop(c._loop))
        with caplog.at_level("WARNING", logger="tensorwire.transport"):
            failed = _in_a_thread(lambda: c.get("inline/w"))
        assert isinstance(failed, errors.ConnectionLost) and "outside its loop" in str(failed), failed
        assert any(r.getMessage() == "inline call waited on the loop" for r in caplog.records)
        monkeypatch.undo()
        assert torch.equal(c.get("inline/w"), torch.ones(BIG))  # on a fresh connection
        assert lent.closed and _transport(c) is not lent


def test_an_inline_call_that_waits_on_the_loop_is_made_on_the_loop(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With retries, the call that waited on the loop is made again through it: it succeeds,
    visibly (the warning, one call through the loop, a new connection)."""
    with tensorwire.connect(server.url) as c:
        c.put("inline/v", torch.full((BIG,), 2.0))
        lent = _transport(c)
        loop = _LoopCalls(c)
        monkeypatch.setattr(LentTcp, "recv_into", _waits_on_the_loop(c._loop))
        with caplog.at_level("WARNING", logger="tensorwire.transport"):
            got = _in_a_thread(lambda: c.get("inline/v"))
        assert isinstance(got, torch.Tensor) and torch.equal(got, torch.full((BIG,), 2.0)), got
        assert loop.count == 1 and lent.closed and _transport(c) is not lent
        assert any(r.getMessage() == "inline call waited on the loop" for r in caplog.records)


@pytest.fixture(scope="module")
def process() -> Iterator[ServerProcess]:
    with ServerProcess(capacity="64MiB", extra=["--idle-timeout", "0.5"]) as srv:
        yield srv


def test_a_connection_dropped_while_lent_is_replaced(process: ServerProcess) -> None:
    """The server drops the lent connection (its idle timeout): the next call, even a delete that
    is never retried, goes out on a fresh connection instead of failing on the dead one."""
    with tensorwire.connect(process.url, retries=0) as c:
        for name in ("inline/a", "inline/b"):
            c.put(name, torch.ones(3))
        old = _transport(c)
        assert _lent(c)
        wait_for(lambda: not old._stream.take_back(), 10, "the server to drop the idle connection")
        c.delete("inline/a")  # through the loop: the loan's end sees the close and reconnects
        assert old.closed and _transport(c) is not old
        assert torch.equal(c.get("inline/b"), torch.ones(3))
        assert _lent(c)
        fresh = _transport(c)
        wait_for(lambda: not fresh._stream.take_back(), 10, "the server to drop the idle connection")
        assert torch.equal(c.get("inline/b"), torch.ones(3))  # inline on the dead one, then again


def test_a_stopped_server_times_out_an_inline_get(process: ServerProcess) -> None:
    with tensorwire.connect(process.url, timeout=0.5, retries=0) as c:
        c.put("inline/s", torch.ones(3))
        assert _lent(c)
        process.signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(errors.TransferTimeout, match="get of 'inline/s'"):
                c.get("inline/s")
            assert time.monotonic() - start < 5  # one attempt (retries=0): the one inline
        finally:
            process.signal(signal.SIGCONT)
        assert torch.equal(c.get("inline/s"), torch.ones(3))


def test_a_deadline_cuts_an_inline_call_short(process: ServerProcess) -> None:
    deadline = tensorwire.client.options.Deadline.after(1.0, "the test's call (1s)")
    with tensorwire.connect(process.url, timeout=30, deadline=deadline) as c:
        c.put("inline/d", torch.ones(3))
        process.signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(errors.TransferTimeout):
                c.get("inline/d")
            assert time.monotonic() - start < 5
        finally:
            process.signal(signal.SIGCONT)


def test_a_closed_client_wakes_its_borrower(process: ServerProcess) -> None:
    """close() from another thread while a thread waits inline: the waiter fails at once."""
    c = tensorwire.connect(process.url, timeout=30, retries=0)
    c.put("inline/c", torch.ones(3))
    failed: list[BaseException] = []

    def read() -> None:
        try:
            c.get("inline/c")
        except errors.TensorwireError as exc:
            failed.append(exc)

    process.signal(signal.SIGSTOP)
    try:
        reader = threading.Thread(target=read)
        reader.start()
        loan = _transport(c)._lending.loan
        assert loan is not None
        wait_for(lambda: loan.borrower is not None, 5, "the get to borrow the connection")
        c.close()
        reader.join(10)
        assert not reader.is_alive() and failed, "the borrower still waits on a closed client"
    finally:
        process.signal(signal.SIGCONT)
