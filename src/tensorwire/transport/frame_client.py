"""The client side of the tensorwire frame protocol over any ByteStream (TCP, in-process).

Requests carry ids and may overlap: a writer lock keeps frames whole, and whoever holds the reader
role (a caller alone in flight, else a background task) matches each response to its request,
landing GET data straight in the buffers the caller's sink hands out, checking each chunk as it
arrives. While the connection is lent to a thread (lending.py), that thread's requests run the
same code over the lent stream (``_call_lent``) and the loop's take the connection back first.

``FramedTransport`` is a ``Transport`` and a ``FrameChannel`` (``call``: any request).
``RangedTransport`` (ranged.py), the one tcp://, tls:// and memory:// open, carries the tensors'
bytes in its frames and so is also ``Ranged``, ``Resumable`` and ``Lendable``; ``ShmTransport``
(shm.py) builds on ``FramedTransport`` and moves bytes through shared segments instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tensorwire.errors import (
    ConnectionLost,
    InvalidTensor,
    ProtocolError,
    TensorwireError,
    TransferTimeout,
    UnsupportedVersion,
    error_for_code,
)
from tensorwire.transport.base import Buffer, ByteStream, Progress, PutBatch, Sink, Transport
from tensorwire.transport.frame_io import FrameReader, read_head, recv_data, send_frame, skip_data
from tensorwire.transport.lending import Loan, Outcome
from tensorwire.types import Address, Generation, Limits, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import (
    DEFAULT_CHUNK_BYTES,
    PROTOCOL_VERSIONS,
    Flags,
    Header,
    Opcode,
    check_meta_crc,
    decode_header,
)

T = TypeVar("T")
Answer = tuple[Header, wm.MetaReader]

# What a client accepts from a server: generous, but every length is still bounded.
CLIENT_LIMITS = Limits(max_meta_bytes=256 << 20, max_batch=10_000_000, max_request_bytes=1 << 50)


@dataclass(slots=True)
class _Pending:
    opcode: int
    # Settled by whoever reads the answer; a borrower's (``_call_lent``) is a thread's future.
    future: asyncio.Future[Answer] | Outcome
    wait: float  # seconds it may take, its send included
    deadline: float  # the loop time those seconds end at
    what: str
    sink: Sink | None = None
    progress: Callable[[int], None] | None = None


class FramedTransport(Transport):
    def __init__(
        self,
        address: Address,
        stream: ByteStream,
        checksum: ChecksumKind = ChecksumKind.XXH3_64,
        chunk_size: int = DEFAULT_CHUNK_BYTES,
        timeout: float = 60.0,
        *,
        compression: str = "none",
    ) -> None:
        self.address = address
        self.compression = lossless.check_mode(compression)  # asked for; HELLO settles what is used
        self.encoder: lossless.Encoder | None = None  # how this side's puts are compressed
        self._stream = stream
        self._reader = FrameReader(stream)
        self._checksum = checksum
        self._chunk_size = chunk_size
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._write_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._closing: asyncio.Task[None] | None = None
        self.timeout = timeout  # seconds one request may take, its send included
        self._max_inflight = Limits().max_inflight  # the server's own, after HELLO
        self._room: asyncio.Event | None = None  # set when a request finishes while others wait
        # One timer for all requests, armed for the earliest deadline (see _arm): a timer per
        # request cost more than the rest of a small request's bookkeeping together.
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = 0.0
        self._answering: _Pending | None = None  # out of the table while its answer is read
        self._closed = False
        self._failure: TensorwireError | None = None
        self._version = PROTOCOL_VERSIONS[-1]
        # The reader: whoever reads answers off the stream, one at a time. A caller alone in flight
        # reads its own answer (``_read_until``): waking a reader task that then wakes the caller
        # cost an event-loop turn per request. A background task reads for callers that find
        # someone else reading, and when the stream turns readable while nobody reads (the server
        # closed the connection, or failed it with an error frame); on a stream that cannot say so
        # (``watch_idle`` is False) it reads for as long as the connection lives.
        self._reading = False
        self._reader_task: asyncio.Task[None] | None = None
        self._watched = stream.watch_idle(self._readable_while_idle)
        self._loan: Loan | None = None  # while another thread drives the connection (RangedTransport.lend)
        if not self._watched:
            self._start_reader()
        self.info = wm.ServerInfo(self._version, Limits(), 0, 0)

    @property
    def closed(self) -> bool:
        return self._closed

    async def hello(self, token: str | None = None) -> wm.ServerInfo:
        """Agree on a protocol version, authenticate with ``token``, learn the server's limits and
        its store's identity (``info.store_id``; 0 from a server that predates it)."""
        wants = wm.HELLO_WANTS_STORE_ID | wm.HELLO_WANTS_LOCATION
        info = await self._hello(token, self.compression != "none", wants)
        if info.codecs & (1 << lossless.Encoder(self.compression).codec) and self.compression != "none":
            self.encoder = lossless.Encoder(self.compression)
        if info.version not in PROTOCOL_VERSIONS:
            raise UnsupportedVersion(f"server chose version {info.version}; we speak {PROTOCOL_VERSIONS}")
        self._version = info.version
        self._chunk_size = min(
            max(self._chunk_size, info.limits.min_chunk_bytes), info.limits.max_chunk_bytes
        )
        self.info = info
        self._max_inflight = info.limits.max_inflight
        return info

    async def _hello(self, token: str | None, compress: bool, wants: int = 0) -> wm.ServerInfo:
        versions = PROTOCOL_VERSIONS[0], PROTOCOL_VERSIONS[-1]
        asked = lossless.MODE_CODES[self.compression]
        compression = wm.Compression(lossless.SUPPORTED_MASK, asked) if compress else None
        hello = wm.encode_hello_request(*versions, token, compression, wants)
        try:
            _, reader = await self._call(Opcode.HELLO, hello, what="HELLO")
        except ProtocolError as exc:
            if isinstance(exc, UnsupportedVersion) or not (compress or wants):
                raise
            if wants:  # a server from before the wants field: ask as it understands
                return await self._hello(token, compress)
            return await self._hello(token, False)  # a server from before compression: raw it is
        return finish(reader, wm.decode_hello_response(reader))

    # -- operations ----------------------------------------------------------------------------
    async def put(self, batch: PutBatch, progress: Progress | None = None) -> int:
        what = f"put of {describe(batch.names)}"
        op = Opcode.PUT if len(batch.names) == 1 else Opcode.PUT_MANY
        _, reader = await self._call(op, b"", batch=batch, progress=progress, what=what)  # no head
        return finish(reader, reader.u64())

    async def get(
        self, names: Sequence[str], sink: Sink, progress: Callable[[int], None] | None = None
    ) -> list[TensorMeta]:
        op = Opcode.GET if len(names) == 1 else Opcode.GET_MANY
        landed: list[list[TensorMeta]] = []

        def land(metas: list[TensorMeta]) -> list[memoryview]:
            landed.append(metas)  # the records are decoded once, by the reader task
            return sink(metas)

        what = f"get of {describe(names)}"
        _, reader = await self._call(op, wm.encode_names(names), sink=land, progress=progress, what=what)
        return finish(reader, landed[-1])

    async def delete(self, names: Sequence[str]) -> int:
        what = f"delete of {describe(names)}"
        _, reader = await self._call(Opcode.DELETE, wm.encode_names(names), what=what)
        return finish(reader, reader.u32())

    async def stat(self, names: Sequence[str]) -> list[TensorMeta]:
        _, reader = await self._call(Opcode.STAT, wm.encode_names(names), what=f"stat of {describe(names)}")
        return finish(reader, wm.decode_records(reader))

    async def list(self, prefix: str, limit: int) -> list[TensorMeta]:
        request = wm.encode_list_request(prefix, limit)
        _, reader = await self._call(Opcode.LIST, request, what=f"list of {prefix!r}")
        return finish(reader, wm.decode_records(reader))

    async def ping(self) -> None:
        _, reader = await self._call(Opcode.PING, b"", what="ping")
        reader.done()

    async def call(
        self,
        opcode: int,
        meta: bytes,
        data: Sequence[memoryview] = (),
        sink: Sink | None = None,
        *,
        what: str,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> wm.MetaReader:
        """Any request as one frame: ``meta``, then ``data``; the answer's metadata comes back.

        With ``sink`` the answer's metadata must start with tensor records (the reader returned is
        past them) and its data lands in the buffers the sink hands out. ``timeout`` replaces the
        transport's own for this request (a parameter-server pull may wait for a whole step).
        """
        _, reader = await self._call(
            opcode, meta, data=data, sink=sink, what=what, timeout=timeout, progress=progress
        )
        return reader

    # GEN_WAIT: part of ``Generational`` (RangedTransport) and of ``GenerationViews`` (shm.py).
    async def wait(self, prefix: str, after: int, timeout: float) -> Generation:
        request = wg.encode_wait(prefix, after, max(1, round(timeout * 1000)))
        what = f"wait for a generation of {prefix!r} after {after}"
        # The server answers at ``timeout`` (WaitTimeout); this side's own timer only backs it up.
        _, reader = await self._call(Opcode.GEN_WAIT, request, what=what, timeout=timeout + self.timeout)
        return finish(reader, wg.decode_generation(reader))

    # GEN_PUBLISH_PART (``PartPublisher``): its bytes travel in frames (shm.py overrides it: segments).
    async def publish_part(
        self, prefix: str, batch: PutBatch, *, txn: bytes, index: int, count: int, timeout: float
    ) -> Generation:
        ms = max(1, min(round(timeout * 1000), 0xFFFFFFFF))
        head = wg.encode_part_head(wg.PartHead(prefix, txn, index, count, ms))
        what = f"part {index} of {count} of a publish under {prefix!r}"
        # The server answers once every part is in, or at ``timeout``; this timer only backs it up.
        _, reader = await self._call(
            Opcode.GEN_PUBLISH_PART, head, batch=batch, what=what, timeout=timeout + self.timeout
        )
        return finish(reader, wg.decode_generation(reader))

    async def close(self) -> None:
        await self._fail(ConnectionLost(f"connection to {self.address} was closed by the client"))

    # -- machinery -----------------------------------------------------------------------------
    def _header(self, opcode: int, rid: int, meta: bytes, data_len: int, flags: int = 0) -> Header:
        # chunk_size is sent even without data: the server answers a GET in the same chunk size.
        chunk = self._chunk_size
        return Header(self._version, opcode, flags, self._checksum, rid, len(meta), chunk, data_len)

    async def _send_batch(
        self,
        stream: ByteStream,
        opcode: int,
        rid: int,
        batch: PutBatch,
        *,
        progress: Progress | None,
        head: bytes = b"",
    ) -> None:
        """Send a put as one frame, or as several (flag MORE on all but the last) when the batch has
        several parts: the server takes part k while this side encodes part k+1. Each part's
        metadata block is ``head`` (a GEN_PUBLISH's prefix), then its records."""
        for i in range(batch.parts):
            metas, data = batch.part(i)
            meta = head + wm.encode_records(metas)
            flags = 0 if i == batch.parts - 1 else Flags.MORE
            header = self._header(opcode, rid, meta, sum(d.nbytes for d in data), flags)
            await send_frame(stream, header, meta, data, progress, encoder=self.encoder)

    async def _send_request(
        self,
        stream: ByteStream,
        opcode: int,
        rid: int,
        meta: bytes,
        *,
        batch: PutBatch | None,
        data: Sequence[Buffer],
        progress: Progress | None,
    ) -> None:
        if batch is not None:
            await self._send_batch(stream, opcode, rid, batch, progress=progress, head=meta)
            return
        header = self._header(opcode, rid, meta, sum(memoryview(d).nbytes for d in data))
        await send_frame(stream, header, meta, data, progress if data else None, encoder=self.encoder)

    async def _call(
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
    ) -> tuple[Header, wm.MetaReader]:
        loan = self._loan  # read once: the loop may end the loan (close) while a borrower calls
        if loan is not None:  # the connection is lent: to this very thread, or taken back now
            if loan.borrower == threading.get_ident():
                return await self._call_lent(
                    loan, opcode, meta, batch=batch, data=data, sink=sink, what=what, timeout=timeout
                )
            await self.reclaim()
        if self._closed:
            raise self._failure or ConnectionLost(f"connection to {self.address} is closed")
        rid = next(self._ids)
        loop = self._loop
        future: asyncio.Future[tuple[Header, wm.MetaReader]] = loop.create_future()
        # A deadline, not an asyncio.timeout scope: it is the cheapest finite wait, and it covers
        # the send as well as the answer.
        wait = self.timeout if timeout is None else timeout
        deadline = loop.time() + wait
        pending = _Pending(opcode, future, wait, deadline, what, sink, None if batch else progress)
        self._pending[rid] = pending
        if self._sweep is None or deadline < self._sweep_at:
            self._arm(deadline)
        try:
            while len(self._pending) > self._max_inflight:  # rare: wait for an answer to free a slot
                self._room = self._room or asyncio.Event()
                await self._room.wait()
            try:
                async with self._write_lock:
                    await self._send_request(
                        self._stream, opcode, rid, meta, batch=batch, data=data, progress=progress
                    )
            except ConnectionLost as exc:
                await self._fail(exc)
            except Exception as exc:  # e.g. the caller's progress callback: the frame is half sent
                await self._fail(ConnectionLost(f"a request to {self.address} stopped mid-frame: {exc!r}"))
                _drop_outcome(future)  # the caller hears of its own exception instead
                raise
            if self._reading or future.done():
                return await future  # settled by the reader, the deadline sweep, or _fail
            return await self._read_until(future)
        except asyncio.CancelledError:
            # A request abandoned mid-flight leaves the stream in an unknown state: drop it. Its
            # outcome, if one came meanwhile (a timeout, say), is nobody's to hear any more.
            _drop_outcome(future)
            self._pending.pop(rid, None)
            await self._fail(ConnectionLost(f"request to {self.address} was abandoned mid-flight"))
            raise
        finally:
            self._pending.pop(rid, None)
            if self._room is not None:
                self._room.set()
                self._room = None

    async def reclaim(self) -> None:
        """On the loop: end the loan, once a borrower mid-call is done (each of its requests ends
        by its deadline); drop the connection if that call broke it, or if the peer closed it or
        sent something unasked meanwhile, so the next request goes out on a fresh one."""
        loan = self._loan
        while loan is not None and not loan.lock.acquire(blocking=False):
            await asyncio.sleep(0.001)  # rare: a call from another thread is running
            # Read it again: meanwhile another request may have taken it back and lent it anew
            # (ending only the old loan would leave this request reading a lent stream).
            loan = self._loan
        if loan is None:
            return
        try:  # no await since the loan was read: it is still the connection's
            self._loan = None
            self._reader.switch(self._stream)
            failure = loan.failure
            if failure is None and not self._stream.take_back():
                failure = ConnectionLost(f"{self.address} closed the connection while it was lent")
        finally:
            loan.lock.release()
        if failure is not None:
            await self._fail(failure)
        else:
            self._after_reading()  # watched again for what the server may send unasked

    async def _call_lent(
        self,
        loan: Loan,
        opcode: int,
        meta: bytes,
        *,
        batch: PutBatch | None,
        data: Sequence[memoryview],
        sink: Sink | None,
        what: str,
        timeout: float | None,
    ) -> Answer:
        """``_call`` on the borrowing thread (``run_inline``): the same frames over the lent stream,
        whose waits end at the request's deadline (no sweep, no write lock: the borrower is alone)."""
        stream = loan.stream
        rid = next(self._ids)
        wait = min(self.timeout if timeout is None else timeout, loan.timeout)
        outcome = Outcome()
        pending = _Pending(opcode, outcome, wait, 0.0, what, sink)
        self._pending[rid] = pending
        stream.deadline = time.monotonic() + wait
        try:
            await self._send_request(stream, opcode, rid, meta, batch=batch, data=data, progress=None)
            while not outcome.done():
                await self._read_frame()
        except TransferTimeout as exc:
            waited = f"waited {wait:.3g}s for the answer to the {what} from {self.address}"
            loan.failure = TransferTimeout(waited)
            raise loan.failure from exc
        except BaseException as exc:  # the stream is out of step: the loan's end drops it
            loan.failure = _as_tensorwire(exc, f"a call on {self.address} outside its loop", ConnectionLost)
            raise
        finally:
            self._pending.pop(rid, None)
        answer: Answer = outcome.result()
        return answer  # a refusal (KeyNotFound, say) leaves the connection in step

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
        if later and not self._closed:
            self._arm(min(later))

    def _expire(self, pending: _Pending) -> None:
        """A request's deadline passed: fail it, and drop the connection it is stuck on (also when
        its answer is half received: the reader is cancelled with the connection)."""
        waited = f"waited {pending.wait:.3g}s for the answer to the {pending.what} from {self.address}"
        _settle(pending, error=TransferTimeout(waited))
        lost = ConnectionLost(f"connection to {self.address} dropped: a request on it timed out")
        self._closing = self._loop.create_task(self._fail(lost))

    async def _read_until(
        self, future: asyncio.Future[tuple[Header, wm.MetaReader]]
    ) -> tuple[Header, wm.MetaReader]:
        """As the reader, read answers (anyone's) until the one ``future`` waits for is in; then
        hand the reading over to the background task if others still wait."""
        self._reading = True
        try:
            while not future.done():
                await self._read_frame()
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
        if self._closed:
            return
        if self._pending or not self._watched:
            self._start_reader()
        else:
            self._stream.watch_idle(self._readable_while_idle)

    def _readable_while_idle(self) -> None:
        if not self._reading and not self._closed:
            self._start_reader(once=True)

    async def _read_loop(self, once: bool) -> None:
        """The background reader: while requests wait for answers (``once``: at least one frame, or
        the end of the stream; on a stream without ``watch_idle``: for as long as it lives)."""
        try:
            while once or self._pending or not self._watched:
                once = False
                await self._read_frame()
        except Exception as exc:  # a bug, or a user's callback: never a silently dead reader
            await self._read_failed(exc)
        finally:
            if asyncio.current_task() is self._reader_task:
                self._reading = False
                self._reader_task = None
                self._after_reading()

    async def _read_frame(self) -> None:
        if not await self._reader.at_frame_start():
            raise ConnectionLost(f"{self.address} closed the connection")
        await self._read_response()

    async def _read_failed(self, exc: Exception) -> None:
        if isinstance(exc, TensorwireError):
            await self._fail(exc)
        else:
            await self._fail(ConnectionLost(f"reading from {self.address} failed: {exc!r}"))

    async def _read_response(self) -> None:
        raw = await read_head(self._reader)
        header = decode_header(raw, CLIENT_LIMITS)
        meta = await self._reader.read(header.meta_len)
        check_meta_crc(raw, header, meta)
        if not header.is_response:
            raise ProtocolError(f"{self.address} sent a request frame to a client")
        reader = wm.MetaReader(meta, CLIENT_LIMITS)
        # Taken out as it is answered: a later frame with the same id can never reach its sink.
        pending = self._pending.pop(header.request_id, None)
        if pending is not None and pending.future.done():  # timed out, already failed
            pending = None
        self._answering = pending
        try:
            await self._answer(header, meta, reader, pending)
        except BaseException as exc:
            # Out of the pending table already, so the connection's failure (``_fail``) would not
            # reach it: it fails here, at once, not when its timer runs out.
            lost = ConnectionLost(f"the connection to {self.address} failed mid-answer: {exc!r}")
            _settle(pending, error=exc if isinstance(exc, TensorwireError) else lost)
            raise
        finally:
            self._answering = None

    async def _answer(
        self, header: Header, meta: bytes, reader: wm.MetaReader, pending: _Pending | None
    ) -> None:
        """Settle ``pending`` (None: nobody waits for it any more) with the answer ``header``."""
        if pending is not None and header.opcode not in (pending.opcode, 0):
            raise ProtocolError(f"{self.address} answered request {header.request_id} with another opcode")
        if header.is_error:
            code, message = wm.decode_error(reader)
            await skip_data(self._reader, header)
            if pending is None and header.request_id == 0:
                raise error_for_code(code, message)  # a connection-level error: fail everything
            _settle(pending, error=error_for_code(code, message))
            return
        if pending is not None and pending.sink is not None:
            await self._read_tensors(header, meta, pending)
            return
        await skip_data(self._reader, header)  # a late answer to an abandoned request, or no data
        _settle(pending, result=(header, reader))

    async def _read_tensors(self, header: Header, meta: bytes, pending: _Pending) -> None:
        """Land a GET response's data in the sink's buffers; a refused sink or bad chunk fails only
        this request."""
        probe = wm.MetaReader(meta, CLIENT_LIMITS)
        try:
            assert pending.sink is not None
            metas = wm.decode_records(probe)
            # Sizes are checked before the sink allocates anything for them.
            if sum(m.nbytes for m in metas) != header.data_len:
                raise ProtocolError("response data length does not match its tensor records")
            buffers = pending.sink(metas)
        except Exception as exc:
            await skip_data(self._reader, header)
            _settle(pending, error=_as_tensorwire(exc, "landing the answer"))
            return
        try:
            await recv_data(self._reader, header, buffers, pending.progress)
        except ConnectionLost:
            raise
        except Exception as exc:  # a corrupt chunk, or the caller's progress callback
            _settle(pending, error=_as_tensorwire(exc, "receiving the answer"))
            if not isinstance(exc, TensorwireError):
                raise ConnectionLost(f"a callback failed mid-frame: {exc!r}") from exc  # stream out of step
            return
        _settle(pending, result=(header, probe))

    async def _fail(self, exc: TensorwireError) -> None:
        """Close the connection once and fail every request still waiting with ``exc``."""
        if self._closed:
            return
        self._closed = True
        self._failure = exc
        self._loan = None  # a borrower mid-call wakes to the stream's close below
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for pending in list(self._pending.values()):
            _settle(pending, error=exc)
        self._pending.clear()
        task = self._reader_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._stream.close()  # a caller that reads wakes to find the stream closed


def _as_tensorwire(
    exc: BaseException, what: str, kind: type[TensorwireError] = InvalidTensor
) -> TensorwireError:
    if isinstance(exc, TensorwireError):
        return exc
    error = kind(f"{what} failed: {exc!r}")
    error.__cause__ = exc
    return error


def describe(names: Sequence[str]) -> str:
    """How an error names the tensors of a request: the first, and how many more."""
    first = repr(names[0]) if names else "nothing"
    return first if len(names) <= 1 else f"{first} and {len(names) - 1} more"


def finish(reader: wm.MetaReader, value: T) -> T:
    """``value``, once nothing is left unread in the response's metadata block."""
    reader.done()
    return value


def _drop_outcome(future: asyncio.Future[tuple[Header, wm.MetaReader]]) -> None:
    """Mark the outcome of a request nobody will await as heard (no "exception was never
    retrieved" log when the future is collected)."""
    if future.done() and not future.cancelled():
        future.exception()


def _settle(
    pending: _Pending | None,
    result: tuple[Header, wm.MetaReader] | None = None,
    error: BaseException | None = None,
) -> None:
    if pending is None or pending.future.done():
        return
    if error is not None:
        pending.future.set_exception(error)
    else:
        assert result is not None
        pending.future.set_result(result)
