"""``RangedTransport``: the frame protocol with the tensors' bytes in its frames, what tcp://,
tls:// and memory:// open. Besides ``FramedTransport``'s operations it is ``Ranged`` (PUT_RANGE,
GET_RANGE, PUT_COMMIT), ``Resumable`` (PUT_RESUMABLE), ``Generational`` (GEN_*) and ``Lendable``
(an idle connection lent to a thread that drives it itself: all of it in lending.py); see their
lifecycles in base.py."""

from __future__ import annotations

from collections.abc import Sequence

from tensorwire.errors import ProtocolError
from tensorwire.transport.base import Progress, PutBatch, Sink
from tensorwire.transport.frame_client import FramedTransport, describe, finish
from tensorwire.transport.frame_mux import FrameMux, Requests
from tensorwire.transport.lending import Lending, Lends
from tensorwire.types import Generation, GenerationManifest, TensorMeta
from tensorwire.wire import delta_reads as dr
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import Opcode


class RangedTransport(Lends, FramedTransport):
    """The frame protocol with the tensors' bytes in its frames: ``Ranged`` (PUT_RANGE, GET_RANGE,
    PUT_COMMIT), ``Resumable`` (PUT_RESUMABLE) and ``Generational`` (GEN_*); see their lifecycles
    in base.py. ``Lendable`` too: its requests go through the lending half (lending.py)."""

    def _front(self, mux: FrameMux) -> Requests:
        self._lending = Lending(mux)
        return self._lending.request

    @property
    def parallel(self) -> bool:
        """Whether several connections beat one: where the kernel moves the bytes (sockets)."""
        return self._stream.parallel

    async def put_range(self, upload: int, meta: TensorMeta, offset: int, data: memoryview) -> None:
        what = f"put of bytes {offset}..{offset + data.nbytes} of {meta.name!r}"
        body = wm.encode_resumable(upload, offset, meta)
        _, reader = await self._request(Opcode.PUT_RANGE, body, data=[data], what=what)
        reader.done()

    async def get_range(self, meta: TensorMeta, offset: int, dest: memoryview) -> None:
        length = dest.nbytes

        def sink(metas: list[TensorMeta]) -> list[memoryview]:
            if len(metas) != 1 or metas[0].nbytes != length or metas[0].name != meta.name:
                raise ProtocolError(f"the server answered a range of {meta.name!r} with something else")
            return [dest]

        request = wm.encode_get_range(meta.version, offset, length, meta.name)
        what = f"get of bytes {offset}..{offset + length} of {meta.name!r}"
        _, reader = await self._request(Opcode.GET_RANGE, request, sink=sink, what=what)
        reader.done()

    async def commit(self, upload: int, meta: TensorMeta) -> int:
        request = wm.encode_resumable(upload, 0, meta)
        _, reader = await self._request(Opcode.PUT_COMMIT, request, what=f"commit of {meta.name!r}")
        return finish(reader, reader.u64())

    async def resume_point(self, upload: int, meta: TensorMeta) -> int:
        query = wm.encode_resumable(upload, wm.RESUME_QUERY, meta)
        _, reader = await self._request(
            Opcode.PUT_RESUMABLE, query, what=f"the resume point of {meta.name!r}"
        )
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
        _, reader = await self._request(
            Opcode.PUT_RESUMABLE, body, data=[data[offset:]], what=what, progress=progress
        )
        return finish(reader, reader.u64())

    # -- generations (``Generational``; docs/protocol.md §14) -----------------------------------
    async def publish(self, prefix: str, batch: PutBatch, progress: Progress | None = None) -> Generation:
        what = f"publish of {describe(batch.names)} under {prefix!r}"
        head = wg.encode_prefix(prefix)
        _, reader = await self._request(Opcode.GEN_PUBLISH, head, batch=batch, progress=progress, what=what)
        return finish(reader, wg.decode_generation(reader))

    async def get_at(self, names: Sequence[str], at: int, sink: Sink) -> tuple[str, int, bytes]:
        what = f"get of {describe(names)} at generation {at or 'latest'}"
        _, reader = await self._request(Opcode.GEN_GET, wg.encode_get(at, names), sink=sink, what=what)
        return finish(reader, wg.decode_read_answer(reader))

    async def get_delta_at(self, names: Sequence[str], at: int, base: int, sink: Sink) -> dr.DeltaAnswer:
        what = f"delta get of {describe(names)} at generation {at or 'latest'} from {base}"
        landed: list[TensorMeta] = []

        def keep(metas: list[TensorMeta]) -> list[memoryview]:
            landed[:] = metas
            return sink(metas)

        request = dr.encode_request(at, base, names)
        _, reader = await self._request(Opcode.GEN_GET_DELTA, request, sink=keep, what=what)
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
        _, reader = await self._request(Opcode.GEN_GET_RANGE, request, sink=sink, what=what)
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
        _, reader = await self._request(Opcode.GEN_GET_RANGES, request, sink=sink, what=what)
        return finish(reader, numbers[-1])

    async def manifest(self, prefix: str, at: int) -> GenerationManifest:
        request = wg.encode_manifest_request(prefix, at)
        what = f"manifest of {prefix!r} at generation {at or 'latest'}"
        _, reader = await self._request(Opcode.GEN_MANIFEST, request, what=what)
        return finish(reader, wg.decode_manifest(reader))

    async def lease(self, prefix: str, number: int, seconds: float) -> tuple[float, int]:
        request = wg.encode_lease(prefix, number, min(round(seconds * 1000), 0xFFFFFFFF))
        what = f"lease on generation {number} of {prefix!r}"
        _, reader = await self._request(Opcode.GEN_LEASE, request, what=what)
        ms, oldest = finish(reader, wg.decode_leased(reader))
        return ms / 1000, oldest
