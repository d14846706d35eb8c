"""The store's own operations, as handlers in the server's one opcode table (request.py says how a
handler is called): HELLO, PING, STATUS, PUT and PUT_MANY, GET and GET_MANY, DELETE, STAT, LIST,
the resumable put (PUT_RESUMABLE, §11.6) and striping (PUT_RANGE, PUT_COMMIT, GET_RANGE, §11.7).

A put becomes visible only after every chunk was verified (``TensorStore``). Requests that name
thousands of tensors do their Python work on a worker thread (``_OFF_LOOP_META``), and store calls
that may block on the data directory run on the store's disk thread, so the loop keeps serving the
other connections meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tensorwire._aio import within
from tensorwire._gc import gc_paused
from tensorwire.errors import (
    ConnectionLost,
    InvalidTensor,
    LimitExceeded,
    ProtocolError,
    TensorwireError,
    UnsupportedVersion,
    VersionChanged,
)
from tensorwire.server.metrics import RequestCounts
from tensorwire.server.request import Handler, ReadyHandler, Request, is_peer_token
from tensorwire.server.store_requests import answer_records, check_names, names_of, no_data, one_record
from tensorwire.store import Entry, Reservation, TensorStore
from tensorwire.store.uploads import Upload, UploadBusy, Uploads, client_of
from tensorwire.types import Limits, TensorMeta
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import PROTOCOL_VERSIONS, Flags, Opcode

S = TypeVar("S")
_RID = struct.Struct("<Q")
_U32 = struct.Struct("<I")
# A request that names thousands of tensors costs tens to hundreds of milliseconds of Python work
# (decoding records, checking names, installing or pinning entries, encoding the answer's records):
# from this many metadata bytes or tensors on, that work runs on a worker thread, so the loop
# keeps serving the others meanwhile.
_OFF_LOOP_META = 64 << 10
_OFF_LOOP_TENSORS = 2048
_BUSY_WAIT = 10.0  # most seconds a write waits for another connection to let go of its upload's bytes


@dataclass(eq=False, slots=True)
class Parts:
    """A PUT, PUT_MANY or GEN_PUBLISH being received: its reservation grows with each part that
    arrives, and the first refusal is kept for the answer at the end (``request.Spanning``)."""

    request_id: int
    store: TensorStore
    reservation: Reservation = field(default_factory=Reservation)
    error: TensorwireError | None = None
    head: str | None = None  # what each part's block starts with (a GEN_PUBLISH's prefix)
    # chunk checksums the sender says its bytes have (a part that came through segments: no frame
    # carried them), checked against those computed from the bytes before the part counts
    expected: list[tuple[int, ...]] | None = None

    def abort(self) -> None:
        self.store.abort(self.reservation)


# Reads what a part's metadata block holds before its records (a GEN_PUBLISH's prefix), checked
# against the parts so far; raises to refuse the part.
PartHead = Callable[[wm.MetaReader, Parts], None]
# Called once the last part is in: publishes the parts (or answers their error).
PartsDone = Callable[[Request, Parts], Awaitable[None]]


class StoreOps:
    """The handlers of the store's operations for one server (``frame_handlers``)."""

    def __init__(
        self,
        store: TensorStore,
        limits: Limits,
        uploads: Uploads,
        counts: RequestCounts,
        *,
        status: Callable[[], dict[str, Any]],
        where: Callable[[], wm.Whereabouts],
        store_id: int,
        peer_token: str | None,
        stall_timeout: float,
    ) -> None:
        self.store = store
        self.limits = limits
        self.uploads = uploads
        self.counts = counts
        self._status = status  # the STATUS document (Server.status)
        self._where = where  # where the server runs, its shm:// listener (HELLO; Server.whereabouts)
        self.store_id = store_id
        self.peer_token = peer_token
        self.stall_timeout = stall_timeout

    def frame_handlers(self) -> dict[int, Handler]:
        return {
            Opcode.HELLO: self.hello,
            Opcode.PING: self.ping,
            Opcode.STATUS: self.status,
            Opcode.PUT: self.put_one,
            Opcode.PUT_MANY: self.put,
            Opcode.GET: self.get,
            Opcode.GET_MANY: self.get,
            Opcode.DELETE: self.delete,
            Opcode.STAT: self.stat,
            Opcode.LIST: self.listing,
            Opcode.PUT_RESUMABLE: self.put_resumable,
            Opcode.PUT_RANGE: self.put_range,
            Opcode.PUT_COMMIT: self.put_commit,
            Opcode.GET_RANGE: self.get_range,
        }

    def ready_handlers(self) -> dict[Handler, ReadyHandler]:
        """The forms of some handlers that the loop's readiness callback runs (session.py)."""
        return {self.get: self.get_ready, self.put_one: self.put_ready}

    # -- the connection and the server ----------------------------------------------------------
    async def hello(self, req: Request) -> None:
        """Negotiate the connection (each HELLO again: its version, answer codec and role)."""
        no_data(req)
        lo, hi, offered, compression = wm.decode_hello_request(req.meta)
        wants = wm.decode_hello_wants(req.meta)
        req.meta.done()
        conn = req.connection
        conn.from_peer = is_peer_token(self.peer_token, offered)
        common = [v for v in PROTOCOL_VERSIONS if lo <= v <= hi]
        if not common:
            raise UnsupportedVersion(f"client speaks versions {lo}..{hi}; server speaks {PROTOCOL_VERSIONS}")
        conn.version = common[-1]
        conn.encoder = _answer_encoder(compression)
        codecs = lossless.SUPPORTED_MASK
        info = wm.ServerInfo(conn.version, self.limits, self.store.capacity, self.store.used, codecs,
                             store_id=self.store_id, where=self._where())  # fmt: skip
        await req.reply(wm.encode_hello_response(info, with_codecs=compression is not None, wants=wants))

    async def ping(self, req: Request) -> None:
        no_data(req)
        req.meta.done()
        await req.reply(b"")

    async def status(self, req: Request) -> None:
        """The server's state as JSON (docs/protocol.md §11.9)."""
        req.meta.done()
        no_data(req)
        doc = self._status()
        doc["in_flight"] -= 1  # not counting the asker's own request
        await req.reply(wm.encode_document(json.dumps(doc, sort_keys=True)))

    # -- puts -----------------------------------------------------------------------------------
    async def put_one(self, req: Request) -> None:
        """A PUT: one tensor in one frame (the session refuses MORE on it), so none of a batch's
        state across frames (``put``), and its one record is decoded here, on the loop (the
        server's CPU per 4 KiB put 73-90 -> 57-70 us). A refusal leaves the data for the session
        to skip."""
        await self._store_one(req, one_record(req))

    def put_ready(self, req: Request) -> bytes | None:
        """``put_one`` from the loop's readiness callback (its one chunk whole in the read buffer):
        the answer's frame; None with a data directory, where a commit waits on the disk."""
        if self.store.persistent:
            return None
        res = self.store.reserve([one_record(req)])
        try:
            req.receive_now(res.buffers)
            version = self.store.commit(res)
        except BaseException:
            self.store.abort(res)
            raise
        answer = req.answer_now(_RID.pack(version))
        assert answer is not None  # eight bytes and no data: always one small plain frame
        return answer

    async def _store_one(self, req: Request, meta: TensorMeta) -> None:
        """Reserve ``meta``, receive the request's data into it, publish it and answer."""
        res = self.store.reserve([meta])
        try:
            await req.receive(res.buffers)
        except BaseException:
            self.store.abort(res)
            raise
        await self._commit(req, res)

    async def put(self, req: Request) -> None:
        """A PUT_MANY, or one part of one that arrives in several frames (flag MORE on all parts
        but the last, one request id): the parts are received as they come, while the client
        encodes the next, and committed together when the last one is in."""
        await self.receive_parts(req, self._commit_parts)

    async def _commit_parts(self, req: Request, parts: Parts) -> None:
        await self._commit(req, parts.reservation, parts.error)

    async def receive_parts(self, req: Request, done: PartsDone, head: PartHead | None = None) -> None:
        """One part of a put that may span several frames (PUT_MANY, GEN_PUBLISH): reserved and
        received; ``done`` runs once the last part is in (``head`` reads what a part's block starts
        with, before its records)."""
        header, conn = req.header, req.connection
        more = bool(header.flags & Flags.MORE)  # the session allows it on spanning opcodes only
        parts = conn.spanning
        if not isinstance(parts, Parts):  # the first part: open until the last is in
            parts = Parts(header.request_id, self.store)
            conn.spanning = parts
        try:
            if parts.error is None:
                await self._put_part(req, parts, head)
        except TensorwireError as exc:
            if isinstance(exc, ConnectionLost):
                raise
            parts.error = exc  # keep taking the parts, so the stream stays in step; answer at the end
        await req.skip()  # a refused part, or any part after one: drop its data before answering
        if not more:
            conn.spanning = None
            await done(req, parts)

    async def _put_part(self, req: Request, parts: Parts, head: PartHead | None) -> None:
        header, reader = req.header, req.meta

        def reserve() -> Reservation:
            if head is not None:
                head(reader, parts)
            self.store.admit(reader.peek_count())  # before the records become objects
            metas = wm.decode_records(reader)
            reader.done()
            if sum(m.nbytes for m in metas) != header.data_len:
                raise InvalidTensor("the tensor records' sizes do not add up to the frame's data length")
            return self.store.reserve(metas, parts.reservation)

        part = await cpu(header.meta_len >= _OFF_LOOP_META, reserve)
        await req.receive(part.buffers)

    async def _commit(self, req: Request, res: Reservation, error: TensorwireError | None = None) -> None:
        """Publish ``res`` and answer its version; or drop it and answer ``error``."""
        if error is None and not res.metas:
            error = ProtocolError("PUT_MANY carried no tensors")
        if error is not None:
            self.store.abort(res)
            raise error
        try:
            big = len(res.metas) >= _OFF_LOOP_TENSORS
            version = await self._on_disk(req, self.store.commit, res, big=big)
        except BaseException:
            self.store.abort(res)
            raise
        await req.reply(_RID.pack(version))

    async def _on_disk(self, req: Request, fn: Callable[..., S], *args: object, big: bool = False) -> S:
        """A store call that may block on the data directory (commit, delete): on the store's disk
        thread, so the loop serves others meanwhile; the stall watchdog leaves this request alone
        while the server, not the peer, is what it waits on. Without a data directory, as ``cpu``."""
        if not self.store.persistent:
            return await cpu(big, fn, *args)
        with req.waiting():
            return await self.store.call(fn, *args)

    async def put_resumable(self, req: Request) -> None:
        """One tensor from byte ``offset`` on, into the upload ``upload_id`` (uploads.py). With no
        data and offset ``RESUME_QUERY``, the answer is where to resume from."""
        header = req.header
        upload_id, offset, metas = wm.decode_resumable(req.meta)
        req.meta.done()
        if len(metas) != 1:
            raise ProtocolError(f"PUT_RESUMABLE carries one tensor, not {len(metas)}")
        meta = metas[0]
        client = client_of(req.peer)
        if offset == wm.RESUME_QUERY and not header.data_len:
            self.counts.upload_resumes += 1  # a client asks where to resume: it is retrying
            await req.reply(_RID.pack(self.uploads.resume_point(upload_id, meta, client)))
            return
        if offset + header.data_len != meta.nbytes or not header.data_len:
            raise InvalidTensor(
                f"bytes {offset}..{offset + header.data_len} are not the rest of {meta.name!r}"
            )
        if not self.uploads.slotted(meta):
            await self._put_unslotted(req, meta, offset)
            return
        upload = await self._claim(req, lambda: self.uploads.claim(upload_id, meta, offset, client))
        try:

            def verified(n: int) -> None:
                upload.verified += n

            await req.receive([upload.buffer[offset:]], verified=verified)
        finally:
            self.uploads.release(upload)
        self.uploads.finish(upload)
        await self._commit(req, upload.reservation)

    async def _put_unslotted(self, req: Request, meta: TensorMeta, offset: int) -> None:
        """A PUT_RESUMABLE of a tensor under the server's resumable threshold: a plain put, with no
        upload state kept (a broken one is resumed from 0, which its client hears when it asks)."""
        if offset:
            raise ProtocolError(f"no upload here to resume {meta.name!r} at byte {offset} (start again at 0)")
        self.uploads.counts.unslotted += 1
        await self._store_one(req, meta)

    async def put_range(self, req: Request) -> None:
        """One byte range of a striped put (§11.7): into the upload's reservation, noted once every
        chunk of it is verified; nothing is visible before PUT_COMMIT."""
        upload_id, offset, metas = wm.decode_resumable(req.meta)
        req.meta.done()
        if len(metas) != 1:
            raise ProtocolError(f"PUT_RANGE carries one tensor, not {len(metas)}")
        client, length = client_of(req.peer), req.header.data_len
        upload = await self._claim(
            req, lambda: self.uploads.claim_range(upload_id, metas[0], offset, length, client)
        )
        ok = False
        try:
            await req.receive([upload.buffer[offset : offset + length]])
            ok = True
        finally:
            self.uploads.range_done(upload, offset, ok)
        await req.reply(b"")

    async def _claim(self, req: Request, claim: Callable[[], Upload]) -> Upload:
        """``claim()``; while another connection writes the same bytes, wait for it to let go (at
        most _BUSY_WAIT, or the stall timeout) and try again, then refuse (UploadBusy). A client
        retrying a range after its connection broke usually arrives before the server has seen the
        break; two live writers of the same bytes still never write at once."""
        deadline = time.monotonic() + min(_BUSY_WAIT, self.stall_timeout)
        while True:
            try:
                return claim()
            except UploadBusy as busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                busy.upload.on_release.append(functools.partial(_settle, released))
                with req.waiting(), contextlib.suppress(TimeoutError):  # on the server, not the peer
                    await within(released, left)

    async def put_commit(self, req: Request) -> None:
        upload_id, _, metas = wm.decode_resumable(req.meta)
        req.meta.done()
        if len(metas) != 1 or req.header.data_len:
            raise ProtocolError("PUT_COMMIT names one tensor and carries no data")
        upload = self.uploads.complete(upload_id, metas[0], client_of(req.peer))
        await self._commit(req, upload.reservation)

    # -- reads and the rest ---------------------------------------------------------------------
    async def get(self, req: Request) -> None:
        no_data(req)
        big = req.header.meta_len >= _OFF_LOOP_META
        # A small request runs here and now: a hop through ``cpu`` costs more than its work.
        names = await cpu(big, names_of, req.meta) if big else names_of(req.meta)
        check_names(req.header.opcode, names)
        entries = await _acquire(self.store, names, big) if big else self.store.acquire(names)
        try:
            self._check_answer(entries)
            block = await cpu(big, answer_records, entries) if big else answer_records(entries)
            await req.reply(block, [e.payload for e in entries])
        finally:
            self.store.release(entries)

    def get_ready(self, req: Request) -> bytes | None:
        """``get`` from the loop's readiness callback: a small answer's frame, else None."""
        no_data(req)
        if req.header.meta_len >= _OFF_LOOP_META:
            return None
        names = names_of(req.meta)
        check_names(req.header.opcode, names)
        entries = self.store.acquire(names)
        try:
            self._check_answer(entries)
            return req.answer_now(answer_records(entries), [e.payload for e in entries])
        finally:
            self.store.release(entries)

    def _check_answer(self, entries: list[Entry]) -> None:
        total = sum(e.nbytes for e in entries)
        if total > self.limits.max_request_bytes:
            raise LimitExceeded(f"an answer of {total} bytes exceeds {self.limits.max_request_bytes}")

    async def get_range(self, req: Request) -> None:
        """Bytes ``offset .. offset + length`` of one tensor, of ``version`` (VERSION_CHANGED if it
        has moved on), as one uint8 record of that length."""
        version, offset, length, names = wm.decode_get_range(req.meta)
        req.meta.done()
        if len(names) != 1 or req.header.data_len:
            raise ProtocolError("GET_RANGE names one tensor and carries no data")
        (entry,) = self.store.acquire(names)
        try:
            meta = entry.meta
            if version and meta.version != version:
                raise VersionChanged(f"{meta.name!r} is at version {meta.version} now, not {version}")
            if offset + length > meta.nbytes:
                raise InvalidTensor(f"bytes {offset}..{offset + length} are not inside {meta.name!r}")
            record = TensorMeta(meta.name, torch.uint8, (length,), length, meta.version)
            await req.reply(wm.encode_records([record]), [entry.data[offset : offset + length]])
        finally:
            self.store.release([entry])

    async def delete(self, req: Request) -> None:
        no_data(req)
        names = await cpu(req.header.meta_len >= _OFF_LOOP_META, names_of, req.meta)
        deleted = await self._on_disk(req, self.store.delete, names, big=len(names) >= _OFF_LOOP_TENSORS)
        await req.reply(_U32.pack(deleted))

    async def stat(self, req: Request) -> None:
        no_data(req)
        await req.reply(wm.encode_records(self.store.stat(names_of(req.meta))))

    async def listing(self, req: Request) -> None:
        no_data(req)
        prefix, limit = wm.decode_list_request(req.meta)
        req.meta.done()
        limit = min(limit or self.limits.max_batch, self.limits.max_batch)
        await req.reply(wm.encode_records(self.store.list(prefix, limit)))


async def cpu(big: bool, fn: Callable[..., S], *args: object) -> S:
    """``fn(*args)`` with the cycle collector paused: here when it is small, on a worker thread
    when ``big`` (see _OFF_LOOP_META)."""
    if not big:
        with gc_paused():
            return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, _paused, fn, *args)


async def _acquire(store: TensorStore, names: list[str], big: bool) -> list[Entry]:
    """Pin ``names`` (as ``cpu``); pins taken by a worker thread after this request was
    cancelled are released, not leaked."""
    if not big:
        return store.acquire(names)
    pinning = asyncio.get_running_loop().run_in_executor(None, store.acquire, names)
    try:
        return await asyncio.shield(pinning)
    except asyncio.CancelledError:

        def unpin(done: asyncio.Future[list[Entry]]) -> None:
            if not done.cancelled() and done.exception() is None:
                store.release(done.result())

        pinning.add_done_callback(unpin)
        raise


def _answer_encoder(compression: wm.Compression | None) -> lossless.Encoder | None:
    """How to compress a connection's answers: the codec its HELLO asked for, if the client decodes
    it and this server has it; else raw."""
    if compression is None:
        return None
    mode = {int(code): mode for mode, code in lossless.MODE_CODES.items()}.get(compression.answers, "none")
    if mode == "none":
        return None
    encoder = lossless.Encoder(mode)
    return encoder if compression.accepts & (1 << encoder.codec) else None


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _paused(fn: Callable[..., S], *args: object) -> S:
    with gc_paused():
        return fn(*args)
