"""One connection's requests in flight: the multiplexer under every client of the frame protocol.

Requests carry ids and may overlap. ``FrameMux.request`` sends one (a writer lock keeps frames
whole) and waits for its answer; whoever holds the reader role matches each answer to its request
by id, landing GET data straight in the buffers the request's sink hands out and checking each
chunk as it arrives:

* a caller alone in flight reads its own answer (``_read_until``): waking a reader task that then
  wakes the caller cost an event-loop turn per request;
* a background task (``_read_loop``) reads for callers that find someone else reading, and when
  the stream turns readable while nobody reads (the server closed the connection, or failed it
  with an error frame); on a stream that cannot say so (``watch_idle`` is False) it reads for as
  long as the connection lives.

Every request has a deadline, its send included; one timer (``_arm``, ``_expire_due``) watches the
earliest. A request past its deadline fails, and so does the connection it is stuck on (``fail``):
every other request on it fails with it and the stream is closed.

Lending (lending.py) borrows this connection through the seam at the end of the class:
``hand_over`` stops reading and hands out a twin of the stream; the borrower's requests are
``track``ed, sent with ``framing.whole`` or ``framing.send`` (framing.py) and answered by
``read_frame_now`` (a small answer, with plain calls) or ``read_frame``; ``take_back`` and
``carry_on`` end the loan. The multiplexer knows nothing else of loans. How an answer settles its
request, on either path, is answers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Sequence

from tensorwire.errors import ConnectionLost, ProtocolError, TensorwireError, TransferTimeout
from tensorwire.transport.answers import (
    CLIENT_LIMITS,
    Answer,
    Pending,
    Settles,
    as_tensorwire,
    check_opcode,
    drop_outcome,
    land_now,
    landing,
    lost_mid_answer,
    refused,
    settle,
)
from tensorwire.transport.base import Buffer, ByteStream, Progress, PutBatch, Sink
from tensorwire.transport.frame_io import FrameReader, read_head, recv_data, skip_data
from tensorwire.transport.framing import Framing
from tensorwire.transport.plain import LentStream
from tensorwire.transport.whole import frame_size
from tensorwire.types import Address, Limits
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import HEADER_BYTES, Flags, Header, check_meta_crc, decode_header

_COMPRESSED = int(Flags.COMPRESSED)  # a plain int: IntFlag's operators are slow Python

# What a transport's operations call: ``FrameMux.request``, or ``Lending.request`` in front of it.
Requests = Callable[..., Awaitable[Answer]]


class FrameMux:
    """The requests in flight on one connection (see the module docstring)."""

    def __init__(self, address: Address, stream: ByteStream, framing: Framing, timeout: float) -> None:
        self.address = address
        self.framing = framing
        self.timeout = timeout  # seconds one request may take, its send included
        self.max_inflight = Limits().max_inflight  # the server's own, after HELLO
        self._stream = stream
        self._reader = FrameReader(stream)
        self._ids = itertools.count(1)
        self._pending: dict[int, Pending] = {}
        self._write_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._closing: asyncio.Task[None] | None = None
        self._room: asyncio.Event | None = None  # set when a request finishes while others wait
        # One timer for all requests, armed for the earliest deadline (see _arm): a timer per
        # request cost more than the rest of a small request's bookkeeping together.
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = 0.0
        self._answering: Pending | None = None  # out of the table while its answer is read
        self.closed = False  # set once, by ``fail``: the connection is done
        self._failure: TensorwireError | None = None
        self._reading = False  # someone holds the reader role (see the module docstring)
        self._reader_task: asyncio.Task[None] | None = None
        self._watched = stream.watch_idle(self._readable_while_idle)
        if not self._watched:
            self._start_reader()

    @property
    def stream(self) -> ByteStream:
        return self._stream

    async def request(
        self,
        opcode: int,
        meta: bytes,
        *,
        batch: PutBatch | None = None,
        data: Sequence[memoryview] = (),
        sink: Sink | None = None,
        progress: Callable[[int], None] | None = None,
        what: str = "request",
        timeout: float | None = None,
    ) -> Answer:
        """Send one request and wait for its answer (``timeout``: its own instead of the mux's)."""
        if self.closed:
            raise self._failure or ConnectionLost(f"connection to {self.address} is closed")
        rid = next(self._ids)
        loop = self._loop
        future: asyncio.Future[Answer] = loop.create_future()
        # A deadline, not an asyncio.timeout scope: it is the cheapest finite wait, and it covers
        # the send as well as the answer.
        wait = self.timeout if timeout is None else timeout
        deadline = loop.time() + wait
        self._pending[rid] = Pending(opcode, future, wait, deadline, what, sink, None if batch else progress)
        if self._sweep is None or deadline < self._sweep_at:
            self._arm(deadline)
        try:
            while len(self._pending) > self.max_inflight:  # rare: wait for an answer to free a slot
                self._room = self._room or asyncio.Event()
                await self._room.wait()
            await self._send(future, opcode, rid, meta, batch=batch, data=data, progress=progress)
            if self._reading or future.done():
                return await future  # settled by the reader, the deadline sweep, or fail
            return await self._read_until(future)
        except asyncio.CancelledError:
            # A request abandoned mid-flight leaves the stream in an unknown state: drop it. Its
            # outcome, if one came meanwhile (a timeout, say), is nobody's to hear any more.
            drop_outcome(future)
            self._pending.pop(rid, None)
            await self.fail(ConnectionLost(f"request to {self.address} was abandoned mid-flight"))
            raise
        finally:
            self._pending.pop(rid, None)
            if self._room is not None:
                self._room.set()
                self._room = None

    async def _send(
        self,
        future: asyncio.Future[Answer],
        opcode: int,
        rid: int,
        meta: bytes,
        *,
        batch: PutBatch | None,
        data: Sequence[memoryview],
        progress: Progress | None,
    ) -> None:
        """Send the request under the write lock; a send that breaks off fails the connection."""
        try:
            async with self._write_lock:
                await self.framing.send(
                    self._stream, opcode, rid, meta, batch=batch, data=data, progress=progress
                )
        except ConnectionLost as exc:
            await self.fail(exc)
        except Exception as exc:  # e.g. the caller's progress callback: the frame is half sent
            await self.fail(ConnectionLost(f"a request to {self.address} stopped mid-frame: {exc!r}"))
            drop_outcome(future)  # the caller hears of its own exception instead
            raise

    # -- the deadline sweep ------------------------------------------------------------------------
    def _arm(self, deadline: float) -> None:
        """Have ``_expire_due`` run at ``deadline`` (or earlier, if it is armed for earlier)."""
        if self._sweep is not None:
            self._sweep.cancel()
        self._sweep_at = deadline
        self._sweep = self._loop.call_at(deadline, self._expire_due)

    def _expire_due(self) -> None:
        """The earliest deadline came: fail the requests past theirs, then wait for the next one.
        In a stream of quick requests this runs once per timeout, finding nothing due."""
        self._sweep = None
        now = self._loop.time()
        waiting = [*self._pending.values(), *([self._answering] if self._answering else [])]
        due = [p for p in waiting if p.deadline <= now and not p.future.done()]
        if due:
            self._expire(due[0])
            return  # the connection is dropped with it: every other request fails too
        later = [p.deadline for p in waiting if not p.future.done()]
        if later and not self.closed:
            self._arm(min(later))

    def _expire(self, pending: Pending) -> None:
        """A request's deadline passed: fail it, and drop the connection it is stuck on (also when
        its answer is half received: the reader is cancelled with the connection)."""
        waited = f"waited {pending.wait:.3g}s for the answer to the {pending.what} from {self.address}"
        settle(pending, error=TransferTimeout(waited))
        lost = ConnectionLost(f"connection to {self.address} dropped: a request on it timed out")
        self._closing = self._loop.create_task(self.fail(lost))

    # -- the reader role ---------------------------------------------------------------------------
    async def _read_until(self, future: asyncio.Future[Answer]) -> Answer:
        """As the reader, read answers (anyone's) until the one ``future`` waits for is in; then
        hand the reading over to the background task if others still wait."""
        self._reading = True
        try:
            while not future.done():
                await self.read_frame()
        except Exception as exc:
            await self._read_failed(exc)
        finally:
            self._reading = False
            self._after_reading()
        return await future  # settled: by its answer, or by the failure that ended the reading

    def _start_reader(self, once: bool = False) -> None:
        self._reading = True  # now, not when the task starts: no caller may read meanwhile
        self._reader_task = self._loop.create_task(self._read_loop(once))

    def _after_reading(self) -> None:
        """The reader stopped: answers others wait for go to the background task; with none, the
        stream is watched for what the server may send unasked."""
        if self.closed:
            return
        if self._pending or not self._watched:
            self._start_reader()
        else:
            self._stream.watch_idle(self._readable_while_idle)

    def _readable_while_idle(self) -> None:
        if not self._reading and not self.closed:
            self._start_reader(once=True)

    async def _read_loop(self, once: bool) -> None:
        """The background reader: while requests wait for answers (``once``: at least one frame, or
        the end of the stream; on a stream without ``watch_idle``: for as long as it lives)."""
        try:
            while once or self._pending or not self._watched:
                once = False
                await self.read_frame()
        except Exception as exc:  # a bug, or a user's callback: never a silently dead reader
            await self._read_failed(exc)
        finally:
            if asyncio.current_task() is self._reader_task:
                self._reading = False
                self._reader_task = None
                self._after_reading()

    async def _read_failed(self, exc: Exception) -> None:
        if isinstance(exc, TensorwireError):
            await self.fail(exc)
        else:
            await self.fail(ConnectionLost(f"reading from {self.address} failed: {exc!r}"))

    # -- answers -----------------------------------------------------------------------------------
    async def read_frame(self) -> None:
        """Read one answer off the stream and settle the request it answers."""
        if not await self._reader.at_frame_start():
            raise ConnectionLost(f"{self.address} closed the connection")
        raw = await read_head(self._reader)
        header = decode_header(raw, CLIENT_LIMITS)
        meta = await self._reader.read(header.meta_len)
        pending, reader = self._claim(raw, header, meta)
        self._answering = pending
        try:
            await self._answer(header, meta, reader, pending)
        except BaseException as exc:
            lost_mid_answer(pending, exc, self.address)
            raise
        finally:
            self._answering = None

    def _claim(self, raw: Buffer, header: Header, meta: bytes) -> tuple[Pending | None, wm.MetaReader]:
        """An answer's metadata checked, and the request it answers (None: nobody waits for it
        any more), taken out of the pending table: a later frame with the same id can never reach
        its sink. Out of the table, the connection's failure (``fail``) would not reach it either:
        whoever claims it settles it, even when the answer breaks off (``lost_mid_answer``)."""
        check_meta_crc(raw, header, meta)
        if not header.is_response:
            raise ProtocolError(f"{self.address} sent a request frame to a client")
        pending = self._pending.pop(header.request_id, None)
        if pending is not None and pending.future.done():  # timed out, already failed
            pending = None
        return pending, wm.MetaReader(meta, CLIENT_LIMITS)

    async def _answer(
        self, header: Header, meta: bytes, reader: wm.MetaReader, pending: Pending | None
    ) -> None:
        """Settle ``pending`` (None: nobody waits for it any more) with the answer ``header``."""
        check_opcode(header, pending, self.address)
        if header.is_error:
            await skip_data(self._reader, header)
            refused(header, reader, pending)
            return
        if pending is not None and pending.sink is not None:
            await self._read_tensors(header, meta, pending)
            return
        await skip_data(self._reader, header)  # a late answer to an abandoned request, or no data
        settle(pending, result=(header, reader))

    async def _read_tensors(self, header: Header, meta: bytes, pending: Pending) -> None:
        """Land a GET response's data in the sink's buffers; a refused sink or bad chunk fails only
        this request."""
        landed = landing(header, meta, pending)
        if landed is None:
            await skip_data(self._reader, header)
            return
        probe, buffers = landed
        try:
            await recv_data(self._reader, header, buffers, pending.progress)
        except ConnectionLost:
            raise
        except Exception as exc:  # a corrupt chunk, or the caller's progress callback
            settle(pending, error=as_tensorwire(exc, "receiving the answer"))
            if not isinstance(exc, TensorwireError):
                raise ConnectionLost(f"a callback failed mid-frame: {exc!r}") from exc  # stream out of step
            return
        settle(pending, result=(header, probe))

    async def fail(self, exc: TensorwireError) -> None:
        """Close the connection once and fail every request still waiting with ``exc``."""
        if self.closed:
            return
        self.closed = True
        self._failure = exc
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for pending in list(self._pending.values()):
            settle(pending, error=exc)
        self._pending.clear()
        task = self._reader_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._stream.close()  # a caller that reads wakes to find the stream closed

    # -- the seam lending.py borrows the connection through ---------------------------------------
    def hand_over(self) -> LentStream | None:
        """Stop reading and watching the stream and hand out its twin for another thread to drive
        (``ByteStream.lend``): only while nothing is in flight, being read or sent, or buffered;
        None if not, or if the stream cannot be lent."""
        idle = not (self._pending or self._reading or self._write_lock.locked() or self._reader.buffered)
        if self.closed or not idle:
            return None
        stream = self._stream.lend()
        if stream is None:
            return None
        if self._sweep is not None:  # nothing is in flight: a borrower's waits keep their own time
            self._sweep.cancel()
            self._sweep = None
        self._reader.switch(stream)
        return stream

    def track(self, opcode: int, outcome: Settles, wait: float, what: str, sink: Sink | None) -> int:
        """A borrower's request in the pending table (its stream times it, not the sweep); its id."""
        rid = next(self._ids)
        self._pending[rid] = Pending(opcode, outcome, wait, 0.0, what, sink)
        return rid

    def untrack(self, rid: int) -> None:
        self._pending.pop(rid, None)

    def read_frame_now(self, stream: LentStream) -> bool:
        """``read_frame`` as a plain call, for the borrower of ``stream``, when the answer is small
        and plain: whole in the read buffer, at most one chunk, uncompressed (a small get's or a
        put's). False when it is not: nothing was taken, and ``read_frame`` reads it."""
        buffered = self._reader
        buffered.fill_now(stream, HEADER_BYTES)
        header = decode_header(buffered.peek(HEADER_BYTES), CLIENT_LIMITS)
        data_len = header.data_len
        size = frame_size(header)
        plain = data_len <= header.chunk_size and not header.flags & _COMPRESSED
        if not plain or not buffered.fill_now(stream, size):
            return False
        raw = buffered.take(HEADER_BYTES)
        meta = bytes(buffered.take(header.meta_len))
        data = buffered.take(size - HEADER_BYTES - header.meta_len)
        pending, reader = self._claim(raw, header, meta)
        try:
            check_opcode(header, pending, self.address)
            if header.is_error:
                refused(header, reader, pending)
            elif pending is None or pending.sink is None:
                settle(pending, result=(header, reader))
            else:
                land_now(header, meta, pending, data)
        except BaseException as exc:
            lost_mid_answer(pending, exc, self.address)
            raise
        return True

    def take_back(self, failure: TensorwireError | None) -> TensorwireError | None:
        """The loan ended (no await since the caller saw it): read the stream again. What broke the
        connection while it was lent: ``failure`` (the borrower's), else the peer's close or bytes
        it sent unasked (read already, past an answer, or still in the socket); None if nothing did."""
        self._reader.switch(self._stream)
        if failure is None and (self._reader.buffered or not self._stream.take_back()):
            failure = ConnectionLost(
                f"{self.address} sent bytes unasked, or closed the connection, while it was lent"
            )
        return failure

    @property
    def buffered(self) -> bool:
        """Whether bytes past the last answer were read already (a borrower's call ends the loan)."""
        return bool(self._reader.buffered)

    async def carry_on(self, failure: TensorwireError | None) -> None:
        """After ``take_back``: drop the connection if it broke, else watch it again for what the
        server may send unasked."""
        if failure is not None:
            await self.fail(failure)
        else:
            self._after_reading()
