"""``RangedTransport``: the frame protocol with the tensors' bytes in its frames, what tcp://,
tls:// and memory:// open. Besides ``FramedTransport``'s operations it is ``Ranged`` (PUT_RANGE,
GET_RANGE, PUT_COMMIT), ``Resumable`` (PUT_RESUMABLE), ``Generational`` (GEN_*) and ``Lendable``
(an idle connection lent to a thread that drives it itself: lending.py); see their lifecycles in
base.py."""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from tensorwire._aio import WouldWait, drive
from tensorwire.errors import ConnectionLost, ProtocolError
from tensorwire.transport.base import Progress, PutBatch, Sink
from tensorwire.transport.frame_client import FramedTransport, describe, finish
from tensorwire.transport.lending import Loan, NotLent
from tensorwire.types import Generation, GenerationManifest, TensorMeta
from tensorwire.wire import delta_reads as dr
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import Opcode

T = TypeVar("T")


class RangedTransport(FramedTransport):
    """The frame protocol with the tensors' bytes in its frames: ``Ranged`` (PUT_RANGE, GET_RANGE,
    PUT_COMMIT), ``Resumable`` (PUT_RESUMABLE) and ``Generational`` (GEN_*); see their lifecycles
    in base.py."""

    @property
    def parallel(self) -> bool:
        """Whether several connections beat one: where the kernel moves the bytes (sockets)."""
        return self._stream.parallel

    # -- lending (``Lendable``; lending.py) -------------------------------------------------------
    def lend(self) -> bool:
        """On the loop: lend this connection, if it is idle and its stream can be lent, to the next
        thread that calls ``run_inline``; whether it is lent now. Not while it compresses (a large
        compressed chunk is decoded on a worker thread, a wait a borrower cannot make)."""
        if self._loan is not None:
            return True
        idle = not (self._pending or self._reading or self._write_lock.locked() or self._reader.buffered)
        if self._closed or not idle or self.encoder is not None:
            return False
        stream = self._stream.lend()
        if stream is None:
            return False
        if self._sweep is not None:  # nothing is in flight: a borrower's waits keep their own time
            self._sweep.cancel()
            self._sweep = None
        self._reader.switch(stream)
        self._loan = Loan(stream)
        return True

    def run_inline(
        self, op: Callable[[RangedTransport], Coroutine[Any, Any, T]], timeout: float, spin: float = 0.0
    ) -> T:
        """From a thread other than the loop's: ``op(self)`` (this transport's own operations) run to
        its end in this thread, each request waiting at most ``timeout`` (and the transport's own),
        each wait spinning first for up to ``spin`` seconds.
        NotLent when the connection is not lent now or another thread is using it; any other error
        is the operation's (a TensorwireError; one that broke the connection ends the loan)."""
        loan = self._loan
        if loan is None or not loan.lock.acquire(blocking=False):
            raise NotLent
        try:
            if self._loan is not loan or loan.failure is not None or not loan.stream.quiet():
                raise NotLent  # a connection the server closed while lent: the loop reopens it
            loan.borrower, loan.timeout, loan.stream.spin = threading.get_ident(), timeout, spin
            try:
                return drive(op(self))
            except WouldWait as exc:  # a bug, not the peer: say so, and let the loan's end drop it
                loan.failure = ConnectionLost(f"a call on {self.address} outside its loop: {exc}")
                raise loan.failure from exc
        finally:
            loan.borrower = None
            loan.lock.release()

    async def put_range(self, upload: int, meta: TensorMeta, offset: int, data: memoryview) -> None:
        what = f"put of bytes {offset}..{offset + data.nbytes} of {meta.name!r}"
        body = wm.encode_resumable(upload, offset, meta)
        _, reader = await self._call(Opcode.PUT_RANGE, body, data=[data], what=what)
        reader.done()

    async def get_range(self, meta: TensorMeta, offset: int, dest: memoryview) -> None:
        length = dest.nbytes

        def sink(metas: list[TensorMeta]) -> list[memoryview]:
            if len(metas) != 1 or metas[0].nbytes != length or metas[0].name != meta.name:
                raise ProtocolError(f"the server answered a range of {meta.name!r} with something else")
            return [dest]

        request = wm.encode_get_range(meta.version, offset, length, meta.name)
        what = f"get of bytes {offset}..{offset + length} of {meta.name!r}"
        _, reader = await self._call(Opcode.GET_RANGE, request, sink=sink, what=what)
        reader.done()

    async def commit(self, upload: int, meta: TensorMeta) -> int:
        request = wm.encode_resumable(upload, 0, meta)
        _, reader = await self._call(Opcode.PUT_COMMIT, request, what=f"commit of {meta.name!r}")
        return finish(reader, reader.u64())

    async def resume_point(self, upload: int, meta: TensorMeta) -> int:
        query = wm.encode_resumable(upload, wm.RESUME_QUERY, meta)
        _, reader = await self._call(Opcode.PUT_RESUMABLE, query, what=f"the resume point of {meta.name!r}")
        return finish(reader, reader.u64())

    async def put_resumable(
        self,
        upload: int,
        meta: TensorMeta,
        data: memoryview,
        offset: int = 0,
        progress: Progress | None = None,
    ) -> int:
        body = wm.encode_resumable(upload, offset, meta)
        what = f"put of {meta.name!r} from byte {offset}"
        _, reader = await self._call(
            Opcode.PUT_RESUMABLE, body, data=[data[offset:]], what=what, progress=progress
        )
        return finish(reader, reader.u64())

    # -- generations (``Generational``; docs/protocol.md §14) -----------------------------------
    async def publish(self, prefix: str, batch: PutBatch, progress: Progress | None = None) -> Generation:
        what = f"publish of {describe(batch.names)} under {prefix!r}"
        head = wg.encode_prefix(prefix)
        _, reader = await self._call(Opcode.GEN_PUBLISH, head, batch=batch, progress=progress, what=what)
        return finish(reader, wg.decode_generation(reader))

    async def get_at(self, names: Sequence[str], at: int, sink: Sink) -> tuple[str, int, bytes]:
        what = f"get of {describe(names)} at generation {at or 'latest'}"
        _, reader = await self._call(Opcode.GEN_GET, wg.encode_get(at, names), sink=sink, what=what)
        return finish(reader, wg.decode_read_answer(reader))

    async def get_delta_at(self, names: Sequence[str], at: int, base: int, sink: Sink) -> dr.DeltaAnswer:
        what = f"delta get of {describe(names)} at generation {at or 'latest'} from {base}"
        landed: list[TensorMeta] = []

        def keep(metas: list[TensorMeta]) -> list[memoryview]:
            landed[:] = metas
            return sink(metas)

        request = dr.encode_request(at, base, names)
        _, reader = await self._call(Opcode.GEN_GET_DELTA, request, sink=keep, what=what)
        return finish(reader, dr.decode_answer(reader, landed))

    async def get_range_at(self, name: str, at: int, offset: int, dest: memoryview) -> int:
        length = dest.nbytes
        numbers: list[int] = []

        def sink(metas: list[TensorMeta]) -> list[memoryview]:
            if len(metas) != 1 or metas[0].nbytes != length or metas[0].name != name:
                raise ProtocolError(f"the server answered a range of {name!r} with something else")
            numbers.append(metas[0].version)
            return [dest]

        request = wm.encode_get_range(at, offset, length, name)
        what = f"get of bytes {offset}..{offset + length} of {name!r} at generation {at or 'latest'}"
        _, reader = await self._call(Opcode.GEN_GET_RANGE, request, sink=sink, what=what)
        return finish(reader, numbers[-1])

    async def get_ranges_at(self, name: str, at: int, ranges: Sequence[tuple[int, memoryview]]) -> int:
        total = sum(dest.nbytes for _, dest in ranges)
        numbers: list[int] = []

        def sink(metas: list[TensorMeta]) -> list[memoryview]:
            if len(metas) != 1 or metas[0].nbytes != total or metas[0].name != name:
                raise ProtocolError(f"the server answered ranges of {name!r} with something else")
            numbers.append(metas[0].version)
            return [dest for _, dest in ranges if dest.nbytes]

        request = wg.encode_get_ranges(at, [(o, d.nbytes) for o, d in ranges], name)
        what = f"get of {len(ranges)} ranges of {name!r} at generation {at or 'latest'}"
        _, reader = await self._call(Opcode.GEN_GET_RANGES, request, sink=sink, what=what)
        return finish(reader, numbers[-1])

    async def manifest(self, prefix: str, at: int) -> GenerationManifest:
        request = wg.encode_manifest_request(prefix, at)
        what = f"manifest of {prefix!r} at generation {at or 'latest'}"
        _, reader = await self._call(Opcode.GEN_MANIFEST, request, what=what)
        return finish(reader, wg.decode_manifest(reader))

    async def lease(self, prefix: str, number: int, seconds: float) -> tuple[float, int]:
        request = wg.encode_lease(prefix, number, min(round(seconds * 1000), 0xFFFFFFFF))
        what = f"lease on generation {number} of {prefix!r}"
        _, reader = await self._call(Opcode.GEN_LEASE, request, what=what)
        ms, oldest = finish(reader, wg.decode_leased(reader))
        return ms / 1000, oldest
