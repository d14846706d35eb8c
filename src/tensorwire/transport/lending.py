"""A connection lent to a thread: what the blocking client's plain gets and puts run on.

A blocking ``Client`` runs each call on its event-loop thread and waits: two thread wake-ups per
call, which cost a small request more than everything else in it. So an idle connection may be
*lent* (``Lending.lend``, on the loop): the loop stops reading and watching it
(``FrameMux.hand_over``), and a thread that then calls ``get_now`` or ``put_now`` (``call_now``)
makes the request itself, over a twin of the stream whose waits block that thread in poll(2)
(``tcp.LentTcp``), with no loop turn and no hop: a small request and its answer with plain calls
only (``Framing.whole``, ``FrameMux.read_frame_now``), a larger one by the multiplexer's own
coroutines, stepped in that thread. ``run_inline`` runs any of the transport's operations so.
The loan ends when any request is made on the loop (``reclaim``): it waits for a borrower
mid-call, and drops the connection if its borrower's call broke it or if the peer closed it (or
sent anything unasked) while it was lent.

One thread borrows at a time (``Loan.lock``); another finds it taken (``NOT_LENT``) and goes
through the loop as before.

The invariant: nothing a borrower runs may wait on the event loop. A borrower steps coroutines
in its own thread (``_aio.drive``), which can give a turn to nobody (a bare yield) but cannot wait
for a future: only the loop's thread could settle it, and it does not run the borrower's
coroutine. An operation that awaits a future anyway (a bug) is closed
there, its connection dropped, a warning logged, and the call fails with ConnectionLost naming it
("outside its loop"), which the client retries through the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from tensorwire._aio import WouldWait, drive
from tensorwire.errors import ConnectionLost, TensorwireError, TransferTimeout
from tensorwire.logs import event
from tensorwire.transport.answers import Answer, as_tensorwire
from tensorwire.transport.base import PutBatch, Sink
from tensorwire.transport.frame_client import Landed, finish, get_request, put_request
from tensorwire.transport.frame_mux import FrameMux
from tensorwire.transport.plain import LentStream
from tensorwire.types import TensorMeta

T = TypeVar("T")
log = logging.getLogger("tensorwire.transport")


class NotLent(enum.Enum):
    """``run_inline`` ran nothing: the connection is not lent now, another thread is using it, or
    the server closed it while it was lent (the loop reopens it). Make the call through the loop."""

    NOT_LENT = "not lent"


NOT_LENT = NotLent.NOT_LENT


@runtime_checkable
class Lendable(Protocol):
    """An idle connection another thread may drive itself: ``lend`` (on the loop) hands it over;
    on the borrowing thread, ``get_now`` and ``put_now`` make a get or a put (``Transport.get``,
    ``put``) and ``run_inline`` any of the transport's own operations, to their end, with no loop
    turn and no thread hop; ``reclaim`` (on the loop) ends the loan, and so does any request made
    on the loop. What the blocking client's plain gets and puts run on. tcp:// (not tls://, nor
    memory://, nor a connection that compresses). Each returns NOT_LENT when it made nothing."""

    def lend(self) -> bool: ...

    def run_inline(
        self, op: Callable[[Any], Coroutine[Any, Any, T]], timeout: float, spin: float = 0.0
    ) -> T | NotLent: ...

    def get_now(
        self, names: Sequence[str], sink: Sink, timeout: float, spin: float = 0.0
    ) -> list[TensorMeta] | NotLent: ...

    def put_now(self, batch: PutBatch, timeout: float, spin: float = 0.0) -> int | NotLent: ...

    def reclaim(self) -> Awaitable[None]: ...


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


class Lending:
    """The lending half of one connection: its loan, and every request made while there is one.

    ``request`` is what the transport's operations call: on the borrowing thread it runs the
    request over the lent stream (``_call_lent``); on the loop it ends the loan first (``reclaim``);
    with no loan it is the multiplexer's own ``request``."""

    def __init__(self, mux: FrameMux) -> None:
        self._mux = mux
        self._loan: Loan | None = None

    @property
    def loan(self) -> Loan | None:
        """The loan now; None when the connection is not lent (its failure ends a loan: a
        borrower mid-call wakes to the stream's close)."""
        loan = self._loan
        return loan if loan is not None and not self._mux.closed else None

    def lend(self) -> bool:
        """On the loop: lend this connection, if it is idle and its stream can be lent, to the next
        thread that calls ``run_inline``; whether it is lent now. Not while it compresses (a large
        compressed chunk is decoded on a worker thread, a wait a borrower cannot make)."""
        if self.loan is not None:
            return True
        if self._mux.framing.encoder is not None:
            return False
        stream = self._mux.hand_over()
        if stream is None:
            return False
        self._loan = Loan(stream)
        return True

    def run_inline(
        self, op: Callable[[Any], Coroutine[Any, Any, T]], owner: object, timeout: float, spin: float
    ) -> T | NotLent:
        """From a thread other than the loop's: ``op(owner)`` run to its end in this thread, each
        request waiting at most ``timeout`` (and the connection's own), each wait spinning first
        for up to ``spin`` seconds. NOT_LENT when it ran nothing; any error is the operation's (a
        TensorwireError; one that broke the connection ends the loan)."""
        return self._borrowed(timeout, spin, _drive_op, op, owner)

    def call_now(
        self,
        opcode: int,
        meta: bytes,
        *,
        batch: PutBatch | None,
        sink: Sink | None,
        what: str,
        timeout: float,
        spin: float,
    ) -> Answer | NotLent:
        """``run_inline`` of one request, made with plain calls: no coroutine at all when the
        request and its answer are small (``Framing.whole``, ``FrameMux.read_frame_now``), about
        a tenth less of the client's CPU than stepping them (docs/explanation/performance.md)."""
        return self._borrowed(
            timeout, spin, self._exchange, opcode, meta, batch=batch, data=(), sink=sink, what=what
        )

    def _borrowed(
        self, timeout: float, spin: float, call: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T | NotLent:
        """``call(loan, *args, **kwargs)`` on the loan, if it is there to take: NOT_LENT if not."""
        loan = self._loan  # as ``loan``, without the property's call: this is every inline call
        if loan is None or self._mux.closed or not loan.lock.acquire(blocking=False):
            return NOT_LENT
        try:
            if self._loan is not loan or loan.failure is not None or self._mux.buffered:
                return NOT_LENT  # bytes unasked read with the last answer: the loop drops it
            if not loan.stream.begin():
                return NOT_LENT  # a connection the server closed while lent: the loop reopens it
            loan.borrower, loan.timeout, loan.stream.spin = threading.get_ident(), timeout, spin
            try:
                return call(loan, *args, **kwargs)
            except WouldWait as exc:  # a bug, not the peer: say so, and let the loan's end drop it
                where = f"a call on {self._mux.address} outside its loop: {exc}"
                event(
                    log,
                    logging.WARNING,
                    "inline call waited on the loop",
                    server=self._mux.address,
                    error=where,
                )
                loan.failure = ConnectionLost(where)
                raise loan.failure from exc
            finally:
                loan.stream.end()
        finally:
            loan.borrower = None
            loan.lock.release()

    async def reclaim(self) -> None:
        """On the loop: end the loan, once a borrower mid-call is done (each of its requests ends
        by its deadline); drop the connection if that call broke it, or if the peer closed it or
        sent something unasked meanwhile, so the next request goes out on a fresh one."""
        loan = self.loan
        while loan is not None and not loan.lock.acquire(blocking=False):
            await asyncio.sleep(0.001)  # rare: a call from another thread is running
            # Read it again: meanwhile another request may have taken it back and lent it anew
            # (ending only the old loan would leave this request reading a lent stream).
            loan = self.loan
        if loan is None:
            return
        try:  # no await since the loan was read: it is still the connection's
            self._loan = None
            failure = self._mux.take_back(loan.failure)
        finally:
            loan.lock.release()
        await self._mux.carry_on(failure)

    def request(self, opcode: int, meta: bytes, **request: Any) -> Awaitable[Answer]:
        """``FrameMux.request`` (its arguments), for a connection that may be lent. Not a coroutine
        itself: the caller awaits the one it picks, one frame less on every request."""
        loan = self._loan  # read once: the loop may end the loan (close) while a borrower calls
        if loan is None or self._mux.closed:  # (``loan``, without the property's call)
            return self._mux.request(opcode, meta, **request)
        if loan.borrower == threading.get_ident():
            return self._call_lent(loan, opcode, meta, **request)
        return self._reclaimed(opcode, meta, **request)

    async def _reclaimed(self, opcode: int, meta: bytes, **request: Any) -> Answer:
        """A request on the loop while the connection is lent: the loan ends first."""
        await self.reclaim()
        return await self._mux.request(opcode, meta, **request)

    async def _call_lent(
        self,
        loan: Loan,
        opcode: int,
        meta: bytes,
        *,
        batch: PutBatch | None = None,
        data: Sequence[memoryview] = (),
        sink: Sink | None = None,
        what: str = "request",
        timeout: float | None = None,
        progress: object = None,
    ) -> Answer:
        """A request on the borrowing thread (``_exchange``). It reports no ``progress``: the
        inline path takes only calls without a callback."""
        return self._exchange(
            loan, opcode, meta, batch=batch, data=data, sink=sink, what=what, timeout=timeout
        )

    def _exchange(
        self,
        loan: Loan,
        opcode: int,
        meta: bytes,
        *,
        batch: PutBatch | None,
        data: Sequence[memoryview],
        sink: Sink | None,
        what: str,
        timeout: float | None = None,
    ) -> Answer:
        """A borrower's request: the same frames over the lent stream, whose waits end at the
        request's deadline (no sweep, no write lock: the borrower is alone). Sent and read with
        plain calls when small; otherwise by the multiplexer's own coroutines, stepped here."""
        mux = self._mux
        stream = loan.stream
        wait = min(mux.timeout if timeout is None else timeout, loan.timeout)
        outcome = Outcome()
        rid = mux.track(opcode, outcome, wait, what, sink)
        stream.deadline = time.monotonic() + wait
        try:
            frame = mux.framing.whole(opcode, rid, meta, batch=batch, data=data)
            if frame is not None:
                stream.send_now(frame)
            else:
                drive(mux.framing.send(stream, opcode, rid, meta, batch=batch, data=data, progress=None))
            while not outcome.done():
                if not mux.read_frame_now(stream):
                    drive(mux.read_frame())
        except TransferTimeout as exc:
            waited = f"waited {wait:.3g}s for the answer to the {what} from {mux.address}"
            loan.failure = TransferTimeout(waited)
            raise loan.failure from exc
        except BaseException as exc:  # the stream is out of step: the loan's end drops it
            loan.failure = as_tensorwire(exc, f"a call on {mux.address} outside its loop", ConnectionLost)
            raise
        finally:
            mux.untrack(rid)
        answer: Answer = outcome.result()
        return answer  # a refusal (KeyNotFound, say) leaves the connection in step


def _drive_op(loan: Loan, op: Callable[[Any], Coroutine[Any, Any, T]], owner: object) -> T:
    return drive(op(owner))


class Lends:
    """``Lendable`` for a transport whose requests go through its ``Lending`` (``_lending``)."""

    _lending: Lending

    def lend(self) -> bool:
        return self._lending.lend()

    def run_inline(
        self, op: Callable[[Any], Coroutine[Any, Any, T]], timeout: float, spin: float = 0.0
    ) -> T | NotLent:
        return self._lending.run_inline(op, self, timeout, spin)

    def get_now(
        self, names: Sequence[str], sink: Sink, timeout: float, spin: float = 0.0
    ) -> list[TensorMeta] | NotLent:
        op, request, what = get_request(names)
        landed = Landed(sink)
        answer = self._lending.call_now(
            op, request, batch=None, sink=landed, what=what, timeout=timeout, spin=spin
        )
        return answer if answer is NOT_LENT else finish(answer[1], landed.metas)

    def put_now(self, batch: PutBatch, timeout: float, spin: float = 0.0) -> int | NotLent:
        op, what = put_request(batch)
        answer = self._lending.call_now(
            op, b"", batch=batch, sink=None, what=what, timeout=timeout, spin=spin
        )
        return answer if answer is NOT_LENT else finish(answer[1], answer[1].u64())

    def reclaim(self) -> Awaitable[None]:
        return self._lending.reclaim()
