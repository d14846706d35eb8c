"""A connection lent to a thread: what the blocking client's small calls run on.

A blocking ``Client`` runs each call on its event-loop thread and waits: two thread wake-ups per
call, which cost a small request more than everything else in it. So an idle connection may be
*lent* (``RangedTransport.lend``, on the loop): the loop stops reading and watching it, and a
thread that then calls ``run_inline`` runs one of the transport's own operations to its end
itself, over a twin of the stream whose waits block that thread in poll(2) (``tcp.LentTcp``), with
no loop turn and no hop. The loan ends when any request is made on the loop (``reclaim``): it
waits for a borrower mid-call, and drops the connection if its borrower's call broke it or if the
peer closed it (or sent anything unasked) while it was lent.

One thread borrows at a time (``lock``); another finds it taken (``NotLent``) and goes through the
loop as before.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tensorwire.errors import TensorwireError
from tensorwire.transport.base import LentStream


class NotLent(Exception):
    """``run_inline``: the connection is not lent now, or another thread is using it."""


@dataclass(eq=False)
class Loan:
    stream: LentStream  # the twin a borrower drives
    lock: threading.Lock = field(default_factory=threading.Lock)  # held for each borrowed call
    borrower: int | None = None  # threading.get_ident() of the thread in run_inline
    timeout: float = float("inf")  # the borrower's own cap on one request (a deadline's remainder)
    failure: TensorwireError | None = None  # what broke the connection during a borrowed call


class Outcome:
    """The answer to a borrower's request, settled by its own thread (or the loop's, when the
    connection ends under it): the part of a future a thread that never waits on it needs, without
    the lock and condition of ``concurrent.futures.Future``."""

    __slots__ = ("_error", "_result", "_settled")

    def __init__(self) -> None:
        self._settled = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._settled

    def set_result(self, result: Any) -> None:
        self._result, self._settled = result, True

    def set_exception(self, error: BaseException) -> None:
        self._error, self._settled = error, True

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._result
