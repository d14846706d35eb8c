"""What ``shm://`` and ``rdma://`` share: tensors moved through room the server reserves for them.

Both transports carry control in frames and large bytes outside them (through shared segments,
or one-sided by the RDMA engine), so a put goes the same four steps on either
(``SegmentTransport.put``):

1. reserve: ``RESERVE`` (SHM_PUT, RDMA_PUT) with every tensor's record; the server answers a
   reservation id and a reference (``Ref``) for each tensor it reserved room for (the small ones
   get none);
2. fill: the transport moves each referenced tensor into its room (``_fill``: a copy into the
   segment, a one-sided write) and returns what the commit needs to check it (RDMA: every chunk's
   checksum; shm: nothing);
3. commit: ``COMMIT`` (SHM_COMMIT, RDMA_END) with the small tensors inline, in the frame's data
   section and checksummed like any frame; the answer is the version;
4. release: what a request leaves reserved on the server (a put whose fill failed, a get's
   copies, a view's lease) is handed back in the background: ``_later`` queues it on the loop
   (``_release_soon`` from any thread), one task sends the queue in the frames the transport
   writes for it (``_release_frames``) until it is empty, and ``close`` cancels that task (the
   server frees them all with the connection anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from tensorwire.errors import ConnectionLost, ProtocolError, TensorwireError
from tensorwire.transport.base import Progress, PutBatch
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm


class Ref(Protocol):
    """Where the server put one tensor of a request (``wire.shm.SegmentRef``, ``wire.rdma.BufferRef``):
    the index of its record or name in the request, and its record."""

    @property
    def item(self) -> int: ...

    @property
    def meta(self) -> TensorMeta: ...


R = TypeVar("R", bound=Ref)
Sums = Sequence[tuple[int, ...]]  # every referenced tensor's chunk checksums, by ref (may be empty)


class SegmentTransport(FramedTransport, Generic[R]):
    """A ``FramedTransport`` whose puts reserve, fill, commit and release (the module docstring);
    a subclass supplies the opcodes, ``_decode_refs``, ``_fill``, ``_commit_body`` and
    ``_release_frames``."""

    RESERVE: ClassVar[int]  # the opcode that reserves room for a put
    COMMIT: ClassVar[int]  # the opcode that commits it, the small tensors inline
    ROOM: ClassVar[str]  # what one tensor's room is called in errors: "segment", "buffer"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``FramedTransport``'s own arguments (frame_client.py says which), and an empty queue of
        releases."""
        super().__init__(*args, **kwargs)
        self._releases: list[int] = []
        self._aborts: list[int] = []
        self._flushing: asyncio.Task[None] | None = None

    # -- what a transport supplies ---------------------------------------------------------------
    @abstractmethod
    def _decode_refs(self, reader: wm.MetaReader, count: int) -> list[R]: ...

    @abstractmethod
    async def _fill(
        self, refs: Sequence[R], metas: Sequence[TensorMeta], views: Sequence[memoryview],
        progress: Progress | None,
    ) -> Sums:  # fmt: skip
        """Move every referenced tensor into its room (``_check_ref`` first)."""

    @abstractmethod
    def _commit_body(self, reservation: int, sums: Sums, inline: Sequence[TensorMeta]) -> bytes: ...

    @abstractmethod
    def _release_frames(self, releases: Sequence[int], aborts: Sequence[int]) -> list[tuple[int, bytes, str]]:
        """The frames (opcode, body, what) that hand back ``releases`` and abandoned puts ``aborts``."""

    # -- put -------------------------------------------------------------------------------------
    async def put(self, batch: PutBatch, progress: Progress | None = None) -> int:
        metas, views = gathered(batch)
        what = f"{self.ROOM}s for a put of {len(metas)} tensors"
        reservation, refs = await self._reserve(metas, what)
        try:
            sums = await self._fill(refs, metas, views, progress)
        except BaseException:
            self._later(aborts=[reservation])
            raise
        inline = inline_items(len(metas), refs)
        data = [views[i] for i in inline]
        small = [metas[i] for i in inline]
        return await self._commit(reservation, sums, small, data, what=f"commit of {what}", progress=progress)

    async def _reserve(self, metas: Sequence[TensorMeta], what: str) -> tuple[int, list[R]]:
        """``RESERVE`` for ``metas``: the reservation's id and where each large tensor goes."""
        reader = await self.call(self.RESERVE, wm.encode_records(metas), what=what)
        reservation = reader.u64()
        refs = self._decode_refs(reader, len(metas))
        reader.done()
        return reservation, refs

    def _check_ref(self, ref: R, meta: TensorMeta) -> None:
        """ProtocolError unless the server reserved ``ref`` for ``meta`` (name, dtype, shape, size)."""
        if ref.meta[:4] != meta[:4]:
            raise ProtocolError(f"{self.address} handed out a {self.ROOM} for another tensor")

    async def _commit(
        self, reservation: int, sums: Sums, inline: Sequence[TensorMeta], data: Sequence[memoryview], *,
        what: str, progress: Progress | None = None,
    ) -> int:  # fmt: skip
        """``COMMIT`` the filled reservation with ``inline``'s bytes ``data``: the version."""
        body = self._commit_body(reservation, sums, inline)
        reader = await self.call(self.COMMIT, body, data, what=what, progress=progress)
        return finish_u64(reader)

    # -- releases --------------------------------------------------------------------------------
    def _release_soon(self, loop: asyncio.AbstractEventLoop, lease: int) -> None:
        """Release ``lease`` (from any thread: a view's memory was freed) on the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: so is the connection
            loop.call_soon_threadsafe(self._later, [lease])

    def _later(self, releases: Sequence[int] = (), aborts: Sequence[int] = ()) -> None:
        """Queue ``releases`` and ``aborts`` (puts abandoned before their commit), sent in the
        background; nothing after close: the server dropped them with the connection."""
        if self.closed:
            return
        self._releases += releases
        self._aborts += aborts
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while (self._releases or self._aborts) and not self.closed:
            releases, self._releases = self._releases, []
            aborts, self._aborts = self._aborts, []
            for opcode, body, what in self._release_frames(releases, aborts):
                with contextlib.suppress(TensorwireError):  # a lost connection releases them all
                    await self.call(opcode, body, what=what)

    async def close(self) -> None:
        await super().close()
        if self._flushing is not None:
            self._flushing.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionLost):
                await self._flushing


def gathered(batch: PutBatch) -> tuple[list[TensorMeta], list[memoryview]]:
    """Every part's records and bytes, in order (room is reserved for all of them at once)."""
    metas: list[TensorMeta] = []
    views: list[memoryview] = []
    for i in range(batch.parts):
        part_metas, part_views = batch.part(i)
        metas += part_metas
        views += part_views
    return metas, views


def inline_items(count: int, refs: Sequence[Ref]) -> list[int]:
    """The items of a request the server reserved no room for: they travel inline, in order."""
    reserved = {ref.item for ref in refs}
    return [i for i in range(count) if i not in reserved]


def inline_sink() -> tuple[
    list[TensorMeta], list[memoryview], Callable[[list[TensorMeta]], list[memoryview]]
]:
    """The records and private buffers of the small tensors an answer carries inline, and the sink
    that fills them in."""
    metas: list[TensorMeta] = []
    landed: list[memoryview] = []

    def land(records: list[TensorMeta]) -> list[memoryview]:
        metas.extend(records)
        landed.extend(memoryview(bytearray(m.nbytes)) for m in records)  # small tensors only
        return landed

    return metas, landed, land


def in_order(
    address: object, count: int, inline: Sequence[TensorMeta], refs: Sequence[Ref]
) -> tuple[list[TensorMeta], list[int]]:
    """Every tensor's record in request order, from the refs and the records that came inline, and
    the items that came inline; ProtocolError if the answer has other tensors than asked for."""
    slots = inline_items(count, refs)
    if len(slots) != len(inline):
        raise ProtocolError(f"{address} answered for other tensors than the ones asked for")
    metas: list[TensorMeta | None] = [None] * count
    for ref in refs:
        metas[ref.item] = ref.meta
    for slot, meta in zip(slots, inline, strict=True):
        metas[slot] = meta
    return [m for m in metas if m is not None], slots


def land_inline(
    buffers: Sequence[memoryview],
    slots: Sequence[int],
    landed: Sequence[memoryview],
    progress: Progress | None,
) -> None:
    """Copy the small tensors that came inline into the caller's buffers."""
    for slot, data in zip(slots, landed, strict=True):
        buffers[slot][:] = data
    if progress is not None and landed:
        progress(sum(d.nbytes for d in landed))


def finish_u64(reader: wm.MetaReader) -> int:
    value = reader.u64()
    reader.done()
    return value
