"""client/retry.py: the one reconnecting, retrying call, and its rule (idempotent or never left)."""

from __future__ import annotations

import asyncio
import re

import pytest

from tensorwire._aio import Deadline
from tensorwire.client.retry import RetryPolicy, backoff, retrying
from tensorwire.errors import ConnectError, ConnectionLost, KeyNotFound, TensorwireError

NO_WAIT = RetryPolicy(3, lambda _: 0.0)


class Flaky:
    """A connection maker and an operation that fail as told, and count what they were asked."""

    def __init__(
        self, connect_fails: int = 0, op_fails: int = 0, error: TensorwireError | None = None
    ) -> None:
        self.connect_fails, self.op_fails = connect_fails, op_fails
        self.error = error or ConnectionLost("broken")
        self.connects = self.ops = 0

    async def connect(self) -> str:
        self.connects += 1
        if self.connect_fails:
            self.connect_fails -= 1
            raise ConnectError("down")
        return f"conn{self.connects}"

    async def op(self, conn: str) -> str:
        self.ops += 1
        if self.op_fails:
            self.op_fails -= 1
            raise self.error
        return conn


def run(flaky: Flaky, policy: RetryPolicy = NO_WAIT, **kwargs: object) -> str:
    return asyncio.run(retrying(flaky.op, flaky.connect, policy, **kwargs))  # type: ignore[arg-type]


def test_a_retryable_failure_is_made_again_on_the_connection_connect_hands_out() -> None:
    flaky = Flaky(connect_fails=1, op_fails=2)
    assert run(flaky) == "conn4" and flaky.connects == 4 and flaky.ops == 3


def test_retries_are_bounded_and_the_last_error_is_raised() -> None:
    flaky = Flaky(op_fails=10)
    with pytest.raises(ConnectionLost):
        run(flaky)
    assert flaky.ops == 4  # the first attempt and three retries


def test_an_error_retrying_cannot_help_is_raised_at_once() -> None:
    flaky = Flaky(op_fails=1, error=KeyNotFound("x"))
    with pytest.raises(KeyNotFound):
        run(flaky)
    assert flaky.ops == 1


def test_what_is_not_idempotent_is_retried_only_when_it_never_left() -> None:
    never_left = Flaky(connect_fails=2)
    assert run(never_left, idempotent=False) == "conn3"
    left = Flaky(op_fails=1)
    with pytest.raises(ConnectionLost):
        run(left, idempotent=False)
    assert left.ops == 1


def test_on_retry_sees_each_error_before_the_next_attempt() -> None:
    seen: list[str] = []

    async def note(exc: TensorwireError) -> None:
        seen.append(type(exc).__name__)

    assert run(Flaky(connect_fails=1, op_fails=1), on_retry=note) == "conn3"
    assert seen == ["ConnectError", "ConnectionLost"]


def test_a_deadline_stops_retries_that_the_count_would_allow() -> None:
    flaky = Flaky(op_fails=1000)
    with pytest.raises(ConnectionLost):
        run(flaky, RetryPolicy(None, lambda _: 0.01), deadline=Deadline.after(0.2, "test"))
    assert 2 <= flaky.ops < 1000


def test_backoff_doubles_up_to_its_cap_with_jitter_in_the_upper_half() -> None:
    steady = backoff(0.1, 0.25, jitter=False)
    assert [steady(a) for a in (1, 2, 3, 4)] == [0.1, 0.2, 0.25, 0.25]
    jittered = backoff(0.1, 2.0)
    assert all(0.05 <= jittered(1) <= 0.1 for _ in range(100))


def test_a_connection_that_hangs_is_given_up_at_the_deadline_not_at_its_connect_timeout() -> None:
    """A host cut off by a partition answers no SYN: opening a connection to it waits out the
    connect timeout (10 s for a worker), which the call's deadline must cut short."""
    opened = asyncio.Event()

    async def hangs() -> str:
        opened.set()
        await asyncio.sleep(3600)  # a connect timeout far past the deadline
        return "never"

    async def call() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        what = "PS_PUSH to tcp://10.0.0.9:1"
        with pytest.raises(TensorwireError, match=re.escape(what)):
            await retrying(Flaky().op, hangs, NO_WAIT, deadline=Deadline.after(0.2, what))
        assert opened.is_set()
        return loop.time() - start

    assert asyncio.run(asyncio.wait_for(call(), 30)) < 10


def test_a_wait_that_uses_up_the_deadline_raises_the_last_error_not_a_timeout() -> None:
    """The backoff is cut short at the deadline; an attempt after it would have no time (its
    connect times out at once, naming a wait of ~0 s), so the error that led to the wait is the
    answer: a NOT_PRIMARY naming why, not "waited 6e-05s for a connection"."""
    flaky = Flaky(op_fails=1000, error=ConnectError("this replica is a backup: no primary is known"))

    async def slow_connect() -> str:
        await asyncio.sleep(0)  # one loop turn: more than a spent deadline allows
        return await flaky.connect()

    for _ in range(5):
        with pytest.raises(ConnectError, match="no primary is known"):
            asyncio.run(retrying(flaky.op, slow_connect, RetryPolicy(None, lambda _: 0.05),
                                 deadline=Deadline.after(0.12, "PS_JOIN")))  # fmt: skip
