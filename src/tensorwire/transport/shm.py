"""The client side of ``shm://``: the frame protocol for control, shared-memory segments for bytes.

``ShmTransport`` is a ``SegmentTransport`` (segments.py: a ``FramedTransport``, so a
``FrameChannel``, and ``Viewable``; not ``Ranged``: its bytes go through segments, not frames) on a
loopback TCP connection that, after HELLO, proves it shares the server's segment directory
(SHM_ATTACH: it reads a probe file the server wrote; ``SharedMemoryUnavailable`` if it cannot) and
then moves tensors like this (docs/protocol.md §12):

* ``put``: SHM_PUT asks for segments (the server reserves them), the client copies each tensor
  into its segment once, SHM_COMMIT publishes them all at once. Tensors under 64 KiB travel inside
  SHM_COMMIT's data section instead, checksummed like any frame.
* ``get``: SHM_GET answers with where each tensor lives; the client copies it from the mapped
  segment into the caller's buffer (one memcpy) and checks that the segment's generation did not
  change during the copy (else it copies again: the key was overwritten and its old segment reused).
* ``view``: SHM_GET with a lease: a read-only tensor over the mapped pages; the server pins the
  segment until the tensor's memory is freed (then the client sends SHM_RELEASE).
* ``publish_part`` (``PartPublisher``): as ``put``, but SHM_GEN_PART hands the filled segments to a
  multi-part publish with every tensor's chunk checksums, which the server checks the bytes against.
* ``view_generation`` (``GenerationViews``): SHM_GEN_VIEW, every tensor of one generation as a view
  (§16), under one lease, released once the last of them is freed.

Mappings are cached (segments are reused, so a warm put or get maps nothing and faults no page).
"""

from __future__ import annotations

import asyncio
import functools
import mmap
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tensorwire.errors import (
    CorruptFrame,
    ProtocolError,
    SharedMemoryUnavailable,
)
from tensorwire.transport.base import Listener, Progress, PutBatch, Sink, StreamHandler
from tensorwire.transport.segments import (
    SegmentTransport,
    Sums,
    gathered,
    in_order,
    inline_items,
    inline_sink,
    land_inline,
)
from tensorwire.transport.tcp_listener import listen as listen_tcp
from tensorwire.types import Address, Generation, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire import shm as ws
from tensorwire.wire.checksum import checksum
from tensorwire.wire.frame import Opcode

MAPPINGS = 64  # segments a client keeps mapped (least recently used ones are unmapped first)
COPY_TRIES = 8  # a get whose segment keeps being rewritten under it gives up after this many copies


class _Stale(Exception):
    """A segment changed or vanished under a copy: the key was overwritten; ask again."""


class Mappings:
    """Segments this client mapped, by name and access, least recently used first."""

    def __init__(self, directory: Path, limit: int = MAPPINGS) -> None:
        self.directory = directory
        self.limit = limit
        self._maps: OrderedDict[tuple[str, bool], tuple[mmap.mmap, memoryview]] = OrderedDict()

    def get(self, name: str, writable: bool) -> memoryview:
        """The whole segment (header and data), mapped; _Stale if the file is gone."""
        key = (name, writable)
        hit = self._maps.get(key)
        if hit is not None:
            self._maps.move_to_end(key)
            return hit[1]
        self._forget_unlinked()
        mapped = self._map(name, writable)
        self._maps[key] = mapped
        while len(self._maps) > self.limit:
            self._maps.popitem(last=False)  # unmapped once no view uses it any more
        return mapped[1]

    def _map(self, name: str, writable: bool) -> tuple[mmap.mmap, memoryview]:
        path = self.directory / ws.check_name(name)
        try:
            # O_NOFOLLOW: the server made this name with O_EXCL; a link in its place is not its segment.
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _Stale(name) from None
        except OSError as exc:
            raise SharedMemoryUnavailable(f"cannot open segment {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            # MAP_POPULATE: fault every page in now, in one go, rather than one by one in the copy.
            segment = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, prot)
        except (OSError, ValueError) as exc:
            raise SharedMemoryUnavailable(f"cannot map segment {path}: {exc}") from exc
        finally:
            os.close(fd)
        view = memoryview(segment)
        if size < ws.HEADER_BYTES or ws.unpack_head(view)[1] > size - ws.HEADER_BYTES:
            raise ProtocolError(f"{path} is not a whole tensorwire segment")
        return segment, view

    def _forget_unlinked(self) -> None:
        """Unmap segments the server removed (their memory is freed once nothing maps them)."""
        for key in [k for k in self._maps if not (self.directory / k[0]).exists()]:
            del self._maps[key]

    def clear(self) -> None:
        self._maps.clear()


class ShmTransport(SegmentTransport[ws.SegmentRef]):
    """A client's connection to a server that serves ``shm://`` (see the module docstring; its puts
    go the four steps of segments.py)."""

    RESERVE = Opcode.SHM_PUT
    COMMIT = Opcode.SHM_COMMIT
    ROOM = "segment"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``FramedTransport``'s own arguments (frame_client.py says which)."""
        super().__init__(*args, **kwargs)
        self.directory = ws.shm_dir()
        self.maps = Mappings(self.directory)
        self.copied_bytes = 0  # into and out of segments (``GenerationViews``)

    def note_copied(self, nbytes: int) -> None:
        self.copied_bytes += nbytes

    async def attach(self) -> None:
        """Prove that this process sees the server's segment directory: SharedMemoryUnavailable if not."""
        try:
            reader = await self.call(Opcode.SHM_ATTACH, b"", what="SHM_ATTACH")
        except ProtocolError as exc:
            raise SharedMemoryUnavailable(f"{self.address} does not serve shared memory: {exc}") from exc
        probe, token = ws.check_name(reader.text(255)), reader.u64()
        reader.done()
        try:
            fd = os.open(self.directory / probe, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                seen = f.read(8)
        except OSError:
            seen = b""
        if seen != token.to_bytes(8, "little"):
            raise SharedMemoryUnavailable(
                f"{self.address} keeps its segments where this process cannot see them (another host, "
                f"or another {self.directory}): use tcp:// to reach it"
            )

    # -- put (SegmentTransport.put) ---------------------------------------------------------------------
    def _decode_refs(self, reader: wm.MetaReader, count: int) -> list[ws.SegmentRef]:
        return ws.decode_refs(reader, count)

    def _commit_body(self, reservation: int, sums: Sums, inline: Sequence[TensorMeta]) -> bytes:
        return wm.encode_u64(reservation) + wm.encode_records(inline)

    def _release_frames(self, releases: Sequence[int], aborts: Sequence[int]) -> list[tuple[int, bytes, str]]:
        return [(Opcode.SHM_RELEASE, ws.encode_release(releases, aborts), "SHM_RELEASE")]  # all in one

    # -- a part of a multi-part publish ---------------------------------------------------------------
    async def publish_part(
        self, prefix: str, batch: PutBatch, *, txn: bytes, index: int, count: int, timeout: float
    ) -> Generation:
        """GEN_PUBLISH_PART through segments (``PartPublisher``; docs/protocol.md §12.2): SHM_PUT
        reserves them, each tensor is copied into its segment once, SHM_GEN_PART hands the put to
        the transaction with every tensor's chunk checksums (the server checks the bytes against
        them before the part counts) and the small tensors inline."""
        metas, views = gathered(batch)
        what = f"part {index} of {count} of a publish under {prefix!r}"
        put_id, refs = await self._reserve(metas, f"segments for {what}")
        try:
            sums = self._fill_summed(refs, metas, views)
        except BaseException:
            self._later(aborts=[put_id])
            raise
        ms = max(1, min(round(timeout * 1000), 0xFFFFFFFF))
        head = wg.encode_shm_part(wg.PartHead(prefix, txn, index, count, ms), put_id, sums)
        inline = inline_items(len(metas), refs)
        body = head + wm.encode_records([metas[i] for i in inline])
        # The server answers once every part is in, or at ``timeout``; this timer only backs it up.
        reader = await self.call(Opcode.SHM_GEN_PART, body, [views[i] for i in inline], what=what,
                                 timeout=timeout + self.timeout)  # fmt: skip
        generation = wg.decode_generation(reader)
        reader.done()
        return generation

    async def _fill(
        self, refs: Sequence[ws.SegmentRef], metas: Sequence[TensorMeta], views: Sequence[memoryview],
        progress: Progress | None,
    ) -> Sums:  # fmt: skip
        """Copy each tensor the server handed a segment for into it (the one copy)."""
        for ref in refs:
            self._check_ref(ref, metas[ref.item])
            segment = self._segment(ref, writable=True)
            segment[ws.HEADER_BYTES : ws.HEADER_BYTES + ref.meta.nbytes] = views[ref.item]  # the copy
            self.copied_bytes += ref.meta.nbytes
            if progress is not None:
                progress(ref.meta.nbytes)
        return ()  # SHM_COMMIT checks nothing more: the bytes never left this host

    def _fill_summed(
        self, refs: Sequence[ws.SegmentRef], metas: Sequence[TensorMeta], views: Sequence[memoryview]
    ) -> list[tuple[int, ...]]:
        """``_fill``, and every tensor's chunk checksums (as the manifest's, §14), each chunk summed
        from the segment right after it is copied there, while it is still in the cache."""
        sums: list[tuple[int, ...]] = [()] * len(views)
        for i in inline_items(len(views), refs):
            sums[i] = wg.chunk_checksums(views[i])
        step = wg.CHUNK_BYTES
        for ref in refs:
            self._check_ref(ref, metas[ref.item])
            data = self._segment(ref, writable=True)[ws.HEADER_BYTES : ws.HEADER_BYTES + ref.meta.nbytes]
            src, chunks = views[ref.item], []
            for at in range(0, ref.meta.nbytes, step):
                data[at : at + step] = src[at : at + step]  # the copy
                chunks.append(checksum(wg.CHECKSUM_KIND, data[at : at + step]))
            sums[ref.item] = tuple(chunks)
            self.copied_bytes += ref.meta.nbytes
        return sums

    def _segment(self, ref: ws.SegmentRef, writable: bool) -> memoryview:
        try:
            return self.maps.get(ref.segment, writable)
        except _Stale:
            raise SharedMemoryUnavailable(f"segment {ref.segment} vanished: the server stopped?") from None

    # -- get -----------------------------------------------------------------------------------------
    async def get(
        self, names: Sequence[str], sink: Sink, progress: Progress | None = None
    ) -> list[TensorMeta]:
        for _ in range(COPY_TRIES):
            metas, inline, refs, _ = await self._locate(names, lease=False)
            buffers = sink(metas)
            try:
                for ref in refs:
                    self._copy_out(ref, buffers[ref.item])
                    if progress is not None:
                        progress(ref.meta.nbytes)
            except _Stale:
                continue
            land_inline(buffers, list(inline), list(inline.values()), progress)
            return metas
        raise CorruptFrame(f"the segments of {names[0]!r} were rewritten under {COPY_TRIES} copies in a row")

    def _copy_out(self, ref: ws.SegmentRef, dest: memoryview) -> None:
        """One memcpy from the segment; _Stale if the segment is another tensor's by then."""
        segment = self.maps.get(ref.segment, writable=False)
        if ws.generation(segment) != ref.generation:
            raise _Stale(ref.segment)
        dest[:] = segment[ws.HEADER_BYTES : ws.HEADER_BYTES + ref.meta.nbytes]
        self.copied_bytes += ref.meta.nbytes
        if ws.generation(segment) != ref.generation:  # reused mid-copy: what we copied may be mixed
            raise _Stale(ref.segment)

    async def _locate(
        self, names: Sequence[str], lease: bool
    ) -> tuple[list[TensorMeta], dict[int, memoryview], list[ws.SegmentRef], int]:
        """SHM_GET: every tensor's record in request order, the bytes of those sent inline (by
        index), references to those in segments, and the lease id (0 without a lease)."""
        inline_metas, landed, land = inline_sink()
        body = bytes([ws.GET_LEASE if lease else 0]) + wm.encode_names(names)
        what = f"the segments of {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        reader = await self.call(Opcode.SHM_GET, body, sink=land, what=what)
        refs = ws.decode_refs(reader, len(names))
        lease_id = reader.u64()
        reader.done()
        metas, slots = in_order(self.address, len(names), inline_metas, refs)
        return metas, dict(zip(slots, landed, strict=True)), refs, lease_id

    # -- views ---------------------------------------------------------------------------------------
    async def view(self, name: str) -> torch.Tensor:
        """A read-only tensor over the segment that holds ``name`` (see README, "Shared memory")."""
        metas, inline, refs, lease = await self._locate([name], lease=True)
        if not refs:  # a small tensor, kept in the server's private memory: a private copy
            return _tensor(np.frombuffer(inline[0], dtype=np.uint8), metas[0])
        ref = refs[0]
        try:
            segment = self.maps.get(ref.segment, writable=False)
        except BaseException:
            self._later(releases=[lease])
            raise
        pages = np.frombuffer(segment, dtype=np.uint8, count=ref.meta.nbytes, offset=ws.HEADER_BYTES)
        # The lease ends when the last tensor sharing these pages is freed: torch keeps the numpy
        # array alive for as long as any tensor uses its memory.
        weakref.finalize(pages, self._release_soon, asyncio.get_running_loop(), lease)
        return _tensor(pages, ref.meta)

    async def view_generation(self, prefix: str, at: int) -> tuple[Generation, dict[str, torch.Tensor]]:
        """Generation ``at`` (0: the newest) of ``prefix``: a read-only tensor per full name, over
        the mapped segments (tensors under 64 KiB: private copies that came inline); one lease
        keeps them all, released once the last is freed (``GenerationViews``)."""
        inline_metas, landed, land = inline_sink()
        what = f"a view of generation {at or 'latest'} of {prefix!r}"
        reader = await self.call(
            Opcode.SHM_GEN_VIEW, ws.encode_view_request(prefix, at), sink=land, what=what
        )
        answer = ws.decode_view_answer(reader, inline_metas, prefix)
        names = answer.generation.names
        try:
            pages = [self._pages(ref) for ref in answer.refs]
        except BaseException:
            self._later(releases=[answer.lease] if answer.lease else [])
            raise
        tensors = {names[slot]: _tensor(np.frombuffer(data, dtype=np.uint8), meta)
                   for slot, data, meta in zip(answer.inline, landed, inline_metas, strict=True)}  # fmt: skip
        release = functools.partial(self._release_soon, asyncio.get_running_loop(), answer.lease)
        shared = _SharedLease(len(pages), release)
        for ref, page in zip(answer.refs, pages, strict=True):
            weakref.finalize(page, shared.drop)  # torch keeps ``page`` alive while a tensor uses it
            tensors[names[ref.item]] = _tensor(page, ref.meta)
        return answer.generation, tensors

    def _pages(self, ref: ws.SegmentRef) -> np.ndarray:
        """The leased bytes of ``ref``, mapped; ProtocolError if the segment cannot be what the
        server said (too small, or handed out again under a lease)."""
        segment = self._segment(ref, writable=False)
        generation, capacity = ws.unpack_head(segment)
        if generation != ref.generation or ref.meta.nbytes > capacity:
            raise ProtocolError(f"{self.address} leased segment {ref.segment}, which holds something else")
        return np.frombuffer(segment, dtype=np.uint8, count=ref.meta.nbytes, offset=ws.HEADER_BYTES)

    async def close(self) -> None:
        await super().close()
        self.maps.clear()


class _SharedLease:
    """One lease shared by several views: released when the last of them is freed (any thread)."""

    def __init__(self, views: int, release: Callable[[], None]) -> None:
        self._left = views
        self._release = release
        self._lock = threading.Lock()

    def drop(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._release()


def _tensor(pages: np.ndarray, meta: TensorMeta) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": that is the point
        flat = torch.from_numpy(pages)
    return flat.view(meta.dtype).reshape(meta.shape)


async def listen_stream(address: Address, handler: StreamHandler) -> Listener:
    """The control connections of ``shm://HOST:PORT``: TCP on loopback."""
    return await listen_tcp(address, handler, scheme="shm")
