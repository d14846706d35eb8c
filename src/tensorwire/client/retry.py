"""One reconnecting, retrying call: what every caller that talks to a server over a connection it
may have to reopen uses (the clients, stripe lanes, ``dataset scatter``'s DIGEST requests, and the
parameter-server worker), so that the rule below lives in one place.

The rule: an attempt that failed with a retryable error (``TensorwireError.retryable``: a broken
connection, a timeout, a corrupt chunk; errors.py says which) is made again on a fresh
connection, after a backoff, while the policy's retries and the deadline allow it, and only if
the operation is idempotent or its request never left (the failure was in opening the
connection). Any other error is raised at once.

Lifecycle of one ``retrying`` call, for each attempt in turn:

1. ``connect()`` hands out a connection: the one still open, or a new one (the caller's own
   function, so the caller keeps and shares its connection); with a deadline, opening it waits
   no longer than the time left (a connect timeout longer than the deadline, to a host cut off
   by a partition, would otherwise hold the call that long past it);
2. ``op(connection)`` runs the request on it;
3. on a failure that may be retried, ``on_retry(error)`` runs (drop the connection, move to
   another replica, log), then the backoff sleep (``policy.delay(attempt)``, cut short at the
   deadline), and the next attempt begins; if the sleep left less than ``MIN_ATTEMPT`` of the
   deadline, this error is raised instead (the reason, not the timeout of an attempt with no time).

Nothing here depends on the client's classes: a connection is whatever ``connect`` returns.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tensorwire._aio import Deadline, asyncio_timeout
from tensorwire.errors import TensorwireError

T = TypeVar("T")
C = TypeVar("C")
# Less time than this left after a wait: no new attempt (not even a loopback connect fits), the
# last error is the answer rather than a timeout of an attempt that had no time.
MIN_ATTEMPT = 0.01


def backoff(first: float, cap: float, *, jitter: bool = True) -> Callable[[int], float]:
    """Exponential waits: ``first`` before the first retry, doubling up to ``cap``; with ``jitter``
    each is drawn from its upper half, so that clients that failed together do not retry together."""

    def delay(attempt: int) -> float:
        base = min(cap, first * (2 ** (attempt - 1)))
        return float(base * (0.5 + random.random() / 2)) if jitter else float(base)

    return delay


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a call is made again, and how long to wait before each retry."""

    retries: int | None = 3  # retries after the first attempt; None: as many as the deadline allows
    delay: Callable[[int], float] = field(default=backoff(0.05, 2.0))  # attempt (1, 2, ...) -> seconds

    def allows(self, attempt: int, deadline: Deadline | None) -> bool:
        """Whether another attempt may follow attempt number ``attempt`` (1 for the first)."""
        if self.retries is not None and attempt > self.retries:
            return False
        return deadline is None or deadline.remaining() > 0


async def _connect_within(connect: Callable[[], Awaitable[C]], deadline: Deadline | None) -> C:
    if deadline is None:
        return await connect()
    async with asyncio_timeout(deadline.remaining(), f"a connection for {deadline.what}"):
        return await connect()


async def retrying(
    op: Callable[[C], Awaitable[T]],
    connect: Callable[[], Awaitable[C]],
    policy: RetryPolicy,
    *,
    idempotent: bool = True,
    deadline: Deadline | None = None,
    on_retry: Callable[[TensorwireError], Awaitable[None]] | None = None,
    attempts: int = 0,
) -> T:
    """``op`` on the connection ``connect`` hands out, made again under the module's rule.
    ``attempts``: of this call, made elsewhere already, which count against the policy (the
    blocking client's attempt in the caller's own thread, client/inline.py)."""
    attempt = attempts
    while True:  # not itertools.count: every call of every client starts here
        attempt += 1
        left = False
        try:
            conn = await _connect_within(connect, deadline)
            left = True
            return await op(conn)
        except TensorwireError as exc:
            if not exc.retryable or (left and not idempotent) or not policy.allows(attempt, deadline):
                raise
            if on_retry is not None:
                await on_retry(exc)
            wait = policy.delay(attempt)
            await asyncio.sleep(wait if deadline is None else min(wait, deadline.remaining()))
            if deadline is not None and deadline.remaining() < MIN_ATTEMPT:
                # The wait used up the time: this error says why, not an attempt given none.
                raise
