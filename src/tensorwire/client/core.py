"""The user-facing clients: ``AsyncClient`` (``await tensorwire.aconnect(url)``) and ``Client``
(``tensorwire.connect(url)``), with the same operations.

Every operation runs under a finite timeout; on a retryable failure (a broken connection, a timeout,
a corrupt chunk) it is retried with exponential backoff on a fresh connection, as long as the
operation is idempotent. ``put`` counts as idempotent (putting the same bytes twice leaves the
same value, at a later version); ``delete`` is retried only when the request never left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tensorwire import transport as transports
from tensorwire._aio import Deadline, LoopThread
from tensorwire._gc import gc_paused
from tensorwire.client import staging, stripe
from tensorwire.client.cache import TensorCache
from tensorwire.errors import (
    ConnectError,
    InvalidTensor,
    ProtocolError,
    TensorwireError,
    TransferTimeout,
    VersionChanged,
)
from tensorwire.logs import event
from tensorwire.security import Security, TlsFiles, client_token
from tensorwire.transport.base import Transport
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.transport.shm import view as shm_view
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import Opcode
from tensorwire.wire.names import validate_name, validate_prefix
from tensorwire.wire.tensors import byte_view, check_out, empty_for, sendable

T = TypeVar("T")
log = logging.getLogger("tensorwire.client")
Progress = Callable[[int], None]
TensorItems = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

STAGED_SCHEMES = ("tcp", "tls", "memory")  # the frame protocol's ranged puts and gets stage CUDA tensors
CHECKSUMS = {"xxh3": ChecksumKind.XXH3_64, "crc32c": ChecksumKind.CRC32C}


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a client waits and retries. Every wait is finite."""

    timeout: float = 60.0  # one request: its send and its answer
    connect_timeout: float = 10.0
    retries: int = 3
    backoff: float = 0.05  # first retry delay; doubles each time, with jitter
    max_backoff: float = 2.0
    checksum: str = "xxh3"
    chunk_size: int | None = None
    tls_ca: str | None = None  # the server's CA for tls:// and grpcs:// (None: the system store)
    tls_cert: str | None = None  # this client's certificate and key, for servers that ask (mTLS)
    tls_key: str | None = None
    token: str | None = None  # the server's shared token; None: $TENSORWIRE_TOKEN if set
    # A put of one tensor at least this large resumes after a broken connection from the last
    # verified chunk, not from byte 0 (tcp://, tls://, memory://); 0: never.
    resumable_bytes: int = 64 << 20
    # Lossless chunk compression on tcp://, tls://, memory:// ("none", "lz4", "zstd", or "auto":
    # lz4 only when the codec beats the link; incompressible data always goes raw). Negotiated per
    # connection in HELLO: a server without it gets raw chunks.
    compression: str = "none"
    # A tensor of at least stripe_bytes travels over several connections at once (tcp://, tls://):
    # `stripes` of them, or with 0 one per usable core (at most 8, each range ≥ 16 MiB); 1 (the
    # default): never. Opt-in, since the server receives on one event loop: measure it first.
    # A striped put retries each range on its own; it is not PUT_RESUMABLE.
    stripe_bytes: int = 64 << 20
    stripes: int = 1
    # Cached copies of what `get` read, up to cache_bytes (0: no cache). A cached get costs one STAT,
    # or nothing within cache_lease seconds of the last confirmation (cache.py); copies are keyed by
    # the store that answered (HELLO store_id), so a gRPC server (which gives none) caches nothing.
    cache_bytes: int = 0
    cache_lease: float = 0.0
    # A whole command's deadline (`dataset fetch --deadline`): every call of a blocking Client gives
    # up at it with TransferTimeout, whatever its own timeouts and retries would still allow.
    deadline: Deadline | None = None

    def security(self) -> Security:
        files = [self.tls_cert, self.tls_key, self.tls_ca]
        tls = TlsFiles(*(Path(f) if f else None for f in files)) if any(files) else None
        return Security(tls, client_token(self.token))

    def delay(self, attempt: int) -> float:
        base = min(self.max_backoff, self.backoff * (2 ** (attempt - 1)))
        return float(base * (0.5 + random.random() / 2))

    @property
    def worst_case(self) -> float:
        """An upper bound on one call, retries and backoff included."""
        attempts = self.retries + 1
        return attempts * (self.timeout + self.connect_timeout) + attempts * self.max_backoff + 5.0


class AsyncClient:
    """An asyncio client of one tensorwire server. Safe for concurrent use from one event loop."""

    def __init__(self, url: str, options: ClientOptions | None = None) -> None:
        self.address = Address.parse(url)
        transports.check_scheme(self.address)  # refuse an unknown scheme now, not at first use
        self.options = options or ClientOptions()
        if self.options.checksum not in CHECKSUMS:
            raise ValueError(f"checksum must be one of {sorted(CHECKSUMS)}, not {self.options.checksum!r}")
        lossless.check_mode(self.options.compression)
        self._transport: Transport | None = None
        self._open_lock = asyncio.Lock()
        self.cache = TensorCache(self.options.cache_bytes, self.options.cache_lease)
        self._stripes: stripe.Stripes | None = None
        self._pool: staging.PinnedPool | None = None  # host buffers for CUDA tensors, made on first use
        self._sizes: dict[str, int] = {}  # bytes of tensors this client moved: may a get be striped?
        self.resumed_at: list[int] = []  # where each resumed put went on from (bytes already verified)
        self._closed = False
        self._warned_unverifiable = False

    @property
    def transport(self) -> str:
        """The transport every call of this client takes (the address scheme; never a fallback)."""
        return self.address.scheme

    @property
    def url(self) -> str:
        return str(self.address)

    # -- tensors -------------------------------------------------------------------------------
    async def put(self, name: str, tensor: torch.Tensor, progress: Progress | None = None) -> int:
        """Store ``tensor`` under ``name``; return its new version. A large one (``resumable_bytes``)
        survives broken connections: each retry sends only what the server has not verified."""
        size = tensor.numel() * tensor.element_size()
        self.cache.invalidate(name)
        self._note_size(name, size)
        if tensor.is_cuda and self.transport in STAGED_SCHEMES:
            validate_name(name)
            copier = staging.copier_for(tensor)
            upload, meta = await staging.put_staged(self._run, self._pinned(), name, tensor, copier)
            return await self._commit(upload, meta)
        k = self._stripe_count(size)
        if k > 1:
            return await self._put_striped(name, tensor, k)
        resumable = self.transport not in ("grpc", "shm")  # shm: the bytes never cross the socket
        if self.options.resumable_bytes and size >= self.options.resumable_bytes and resumable:
            return await self._put_resumable(name, tensor, progress)
        return await self.put_many([(name, tensor)], progress=progress)

    async def _put_resumable(self, name: str, tensor: torch.Tensor, progress: Progress | None) -> int:
        validate_name(name)
        sent = sendable(tensor, name)
        view = byte_view(sent)
        meta = TensorMeta(name, sent.dtype, tuple(sent.shape), view.nbytes)
        upload = secrets.randbits(63) or 1
        for attempt in itertools.count():
            try:
                conn = await self._open()
                if not isinstance(conn, FramedTransport):  # grpcs:// and the like: a plain put
                    return await self.put_many([(name, tensor)], progress=progress)
                offset = 0
                if attempt:  # ask the server how much of the upload it holds, verified
                    query = wm.encode_resumable(upload, wm.RESUME_QUERY, meta)
                    reader = await conn.call(
                        Opcode.PUT_RESUMABLE, query, what=f"the resume point of {name!r}"
                    )
                    offset = int(reader.u64())
                    reader.done()
                    self.resumed_at.append(offset)
                body = wm.encode_resumable(upload, offset, meta)
                what = f"put of {name!r} from byte {offset}"
                reader = await conn.call(
                    Opcode.PUT_RESUMABLE, body, [view[offset:]], what=what, progress=progress
                )
                version = int(reader.u64())
                reader.done()
                return version
            except TensorwireError as exc:
                if not exc.retryable or attempt >= self.options.retries:
                    raise
            await asyncio.sleep(self.options.delay(attempt + 1))
        raise AssertionError("unreachable")

    async def put_many(self, items: TensorItems, progress: Progress | None = None) -> int:
        """Store several tensors in one request, atomically (all visible or none, under one new
        version, which is returned). Large batches travel in several frames, pipelined."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        if not pairs:
            raise InvalidTensor("put_many needs at least one tensor")
        for name, _ in pairs:
            self.cache.invalidate(name)
        batch = _Batch(pairs)
        return await self._run(lambda t: t.put(batch, progress))

    async def get(
        self,
        name: str,
        out: torch.Tensor | None = None,
        progress: Progress | None = None,
        *,
        view: bool = False,
    ) -> torch.Tensor:
        """Fetch ``name``. With ``out``, the bytes land in ``out`` in place and ``out`` is returned.

        If the call raises, ``out`` may hold part of the transfer (its contents are unspecified).
        With a cache (``cache_bytes``), an unchanged tensor costs one STAT (or nothing in its lease).
        ``view=True`` (``shm://`` only) returns a read-only tensor over the server's shared pages,
        with no copy: a snapshot of the version read, held for as long as the tensor lives (README,
        "Shared memory").
        """
        if view:
            if out is not None:
                raise InvalidTensor("get(view=True) returns the server's pages; it takes no out=")
            return await self._run(lambda t: shm_view(t, name))
        if not self.cache.enabled:
            return (await self._get(name, out, progress))[0]
        entry = self.cache.lookup(name)
        if entry is not None:
            if self.cache.leased(entry, self._connected_store()):
                self.cache.hits += 1
                return entry.hand_out(out)
            if entry.matches(*await self._stat_with_store(name)):
                self.cache.confirm(entry)
                self.cache.hits += 1
                self.cache.checks += 1
                return entry.hand_out(out)
        before = self._connected_store()
        tensor, version = await self._get(name, out, progress)
        after = self._connected_store()
        # Cached only if one store answered throughout (a reconnect mid-get may have reached another).
        self.cache.store(name, version, tensor, after if after == before or not before else 0)
        if after == 0 and not self._warned_unverifiable:
            self._warned_unverifiable = True
            why = "the server does not say which store answers (gRPC, or an older server)"
            event(log, logging.INFO, "client cache off", server=self.url, reason=why)
        return tensor

    def _connected_store(self) -> int:
        """The store_id of the server this client is connected to now (0: not connected, or a
        server that does not say)."""
        t = self._transport
        return t.info.store_id if t is not None and not t.closed else 0

    async def _stat_with_store(self, name: str) -> tuple[TensorMeta, int]:
        """STAT, and the store_id of the connection that answered it."""

        async def op(t: Transport) -> tuple[TensorMeta, int]:
            metas = await t.stat([name])
            return metas[0], t.info.store_id

        return await self._run(op)

    async def _get(
        self, name: str, out: torch.Tensor | None, progress: Progress | None
    ) -> tuple[torch.Tensor, int]:
        """The tensor and the version it was read at: striped when it is large and its size is
        known here (an ``out``, or an earlier transfer), else one GET."""
        if out is not None and out.is_cuda:
            if self.transport in STAGED_SCHEMES:
                return await self._get_to_device(name, out)
            host, version = await self._get(name, None, progress)  # gRPC: through a CPU tensor
            check_out(TensorMeta(name, host.dtype, tuple(host.shape), 0, version), out, device_ok=True)
            return out.copy_(host), version
        known = out.numel() * out.element_size() if out is not None else self._sizes.get(name, 0)
        k = self._stripe_count(known)
        if k > 1 and (out is None or (out.is_cpu and out.is_contiguous())):
            return await self._get_striped(name, out, k)
        outs = {name: out} if out is not None else {}
        landing = _Landing([name], outs)

        async def op(t: Transport) -> tuple[torch.Tensor, int]:
            landing.reset()
            await t.get([name], landing.sink, progress)
            return landing.finish()[name], landing.versions[name]

        tensor, version = await self._run(op)
        self._note_size(name, tensor.numel() * tensor.element_size())
        return tensor, version

    # -- striping (stripe.py) --------------------------------------------------------------------
    def _stripe_count(self, nbytes: int) -> int:
        if self.transport not in stripe.SCHEMES:
            return 1
        return stripe.stripe_count(nbytes, self.options.stripes, self.options.stripe_bytes)

    def _note_size(self, name: str, nbytes: int) -> None:
        if len(self._sizes) >= 65536:  # a hint, not a registry: start over rather than grow
            self._sizes.clear()
        self._sizes[name] = nbytes

    def _lanes(self) -> stripe.Stripes:
        if self._stripes is None:
            self._stripes = stripe.Stripes(self.address, self._transport_options())
        return self._stripes

    async def _put_striped(self, name: str, tensor: torch.Tensor, k: int) -> int:
        """PUT_RANGE of each range on its own connection, then one PUT_COMMIT publishes the tensor."""
        validate_name(name)
        sent = sendable(tensor, name)
        meta = TensorMeta(name, sent.dtype, tuple(sent.shape), sent.numel() * sent.element_size())
        upload = secrets.randbits(63) or 1
        ops = stripe.put_ops(upload, meta, byte_view(sent), k)
        await self._lanes().run(ops, self.options.retries, self.options.delay)
        return await self._commit(upload, meta)

    async def _commit(self, upload: int, meta: TensorMeta) -> int:
        """PUT_COMMIT: publish an upload whose ranges are all in (striped and staged puts)."""

        async def commit(t: Transport) -> int:
            request = stripe.commit_request(upload, meta)
            reader = await stripe.framed(t).call(Opcode.PUT_COMMIT, request, what=f"commit of {meta.name!r}")
            version = int(reader.u64())
            reader.done()
            return version

        return await self._run(commit, idempotent=False)

    # -- CUDA tensors (staging.py) ----------------------------------------------------------------
    def _pinned(self) -> staging.PinnedPool:
        if self._pool is None:
            self._pool = staging.PinnedPool()
        return self._pool

    async def _get_to_device(self, name: str, out: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Into a device tensor through pinned buffers, pinned to the version a STAT saw."""
        for attempt in itertools.count():
            meta = await self.stat(name)
            check_out(meta, out, device_ok=True)
            try:
                await staging.get_staged(self._run, self._pinned(), meta, out, staging.copier_for(out))
                return out, meta.version
            except VersionChanged:
                if attempt >= self.options.retries:
                    raise
        raise AssertionError("unreachable")

    async def _get_striped(self, name: str, out: torch.Tensor | None, k: int) -> tuple[torch.Tensor, int]:
        """STAT for the version, then each range over its own connection, pinned to that version
        (VERSION_CHANGED: the tensor moved on, read it again)."""
        for attempt in itertools.count():
            meta = await self.stat(name)
            target = out if out is not None else empty_for(meta)
            check_out(meta, target)
            self._note_size(name, meta.nbytes)
            if self._stripe_count(meta.nbytes) <= 1:  # it shrank: one GET will do
                return await self._get(name, out, None)
            try:
                ops = stripe.get_ops(meta, byte_view(target), k)
                await self._lanes().run(ops, self.options.retries, self.options.delay)
                return target, meta.version
            except VersionChanged:
                if attempt >= self.options.retries:
                    raise
        raise AssertionError("unreachable")

    async def get_many(
        self,
        names: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
        progress: Progress | None = None,
    ) -> dict[str, torch.Tensor]:
        """Fetch several tensors in one round trip, as one consistent snapshot."""
        # Names are not validated here: a name that could not be stored is simply not found.
        names = list(dict.fromkeys(names))
        landing = _Landing(names, dict(out or {}))

        async def op(t: Transport) -> dict[str, torch.Tensor]:
            landing.reset()
            await t.get(names, landing.sink, progress)
            return landing.finish()

        return await self._run(op)

    async def delete(self, name: str) -> None:
        """Remove ``name``; KeyNotFound if there is no such tensor."""
        await self.delete_many([name])

    async def delete_many(self, names: Sequence[str]) -> int:
        """Remove all of ``names`` or none of them (KeyNotFound)."""
        for name in names:
            validate_name(name)
            self.cache.invalidate(name)
        return await self._run(lambda t: t.delete(names), idempotent=False)

    async def stat(self, name: str) -> TensorMeta:
        """Metadata (dtype, shape, bytes, version) of ``name`` without its data."""
        metas = await self._run(lambda t: t.stat([name]))
        return metas[0]

    async def list(self, prefix: str = "", limit: int = 0) -> list[TensorMeta]:
        """Metadata of the stored tensors whose names start with ``prefix``, sorted by name."""
        validate_prefix(prefix)
        return await self._run(lambda t: t.list(prefix, limit))

    async def ping(self) -> float:
        """One empty round trip; returns its duration in seconds."""
        start = time.perf_counter()
        await self._run(lambda t: t.ping())
        return time.perf_counter() - start

    async def close(self) -> None:
        self._closed = True
        self.cache.clear()
        if self._stripes is not None:
            stripes, self._stripes = self._stripes, None
            await asyncio.get_running_loop().run_in_executor(None, stripes.close)
        if self._transport is not None:
            await self._transport.close()
            self._transport = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- machinery -----------------------------------------------------------------------------
    async def connect(self) -> AsyncClient:
        """Open the connection now (operations otherwise open it on first use)."""
        await self._open()
        return self

    async def _open(self) -> Transport:
        if self._closed:
            raise ConnectError(f"client of {self.address} is closed")
        t = self._transport
        if t is not None and not t.closed:
            return t  # the common case, without taking the lock
        async with self._open_lock:
            if self._transport is None or self._transport.closed:
                options = self._transport_options()
                previous = self._transport.info.store_id if self._transport is not None else 0
                self._transport = await transports.open_transport(self.address, options)
                if previous and self._transport.info.store_id != previous:
                    self.cache.clear()  # another store now answers here: no copy can be confirmed
            return self._transport

    def _transport_options(self) -> transports.TransportOptions:
        return transports.TransportOptions(
            self.options.connect_timeout,
            self.options.timeout,
            CHECKSUMS[self.options.checksum],
            self.options.chunk_size,
            self.options.security(),
            self.options.compression,
        )

    async def _run(self, op: Callable[[Transport], Awaitable[T]], idempotent: bool = True) -> T:
        attempt = 0
        while True:
            sent = False
            try:
                t = await self._open()
                sent = True
                return await op(t)  # the transport bounds every request by options.timeout
            except TensorwireError as exc:
                if not exc.retryable or attempt >= self.options.retries or (sent and not idempotent):
                    raise
            attempt += 1
            await asyncio.sleep(self.options.delay(attempt))


class _Landing:
    """Where a GET's bytes land: the caller's ``out`` tensors, or new tensors."""

    def __init__(self, names: list[str], outs: Mapping[str, torch.Tensor]) -> None:
        self.names = names
        self.outs = outs
        self.results: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received, non-contiguous out)

    def reset(self) -> None:
        """Forget a failed attempt's landing places before a retry."""
        self.results.clear()
        self.staged.clear()

    def sink(self, metas: list[TensorMeta]) -> list[memoryview]:
        if len(metas) == 1:  # skip the list building and GC pause of the batch path
            if metas[0].name != self.names[0] or len(self.names) != 1:
                raise ProtocolError("the server answered for another tensor than the one asked for")
            return [self._land(metas[0])]
        if [m.name for m in metas] != self.names:
            raise ProtocolError("the server answered for other tensors than the ones asked for")
        with gc_paused():
            return [self._land(meta) for meta in metas]

    def _land(self, meta: TensorMeta) -> memoryview:
        self.versions[meta.name] = meta.version
        out = self.outs.get(meta.name)
        if out is None:
            target = empty_for(meta)
            self.results[meta.name] = target
            return byte_view(target)
        check_out(meta, out)
        self.results[meta.name] = out
        if out.is_contiguous():
            return byte_view(out)
        staged = empty_for(meta)  # a strided out is filled from a contiguous copy after the transfer
        self.staged.append((staged, out))
        return byte_view(staged)

    def finish(self) -> dict[str, torch.Tensor]:
        for received, out in self.staged:
            out.copy_(received)
        return self.results


class _Batch:
    """The tensors of one put, checked now and encoded part by part as the transport sends them
    (see ``PutBatch``). Parts of ``PART_TENSORS`` let the server decode one part while this side
    encodes the next: on a 10,000-tensor batch that hides most of the client's share."""

    PART_TENSORS = 1024

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        with gc_paused():
            for name, tensor in pairs:  # every refusal happens before a byte is sent
                validate_name(name)
                if tensor.dim() > 255:
                    raise InvalidTensor(f"{name!r}: {tensor.dim()} dims cannot be sent (max 255)")
            self.tensors = [sendable(tensor, name) for name, tensor in pairs]
        self.names: Sequence[str] = [name for name, _ in pairs]
        self.parts = -(-len(pairs) // self.PART_TENSORS)
        self._encoded: dict[int, tuple[list[TensorMeta], list[memoryview]]] = {}

    def part(self, index: int) -> tuple[list[TensorMeta], list[memoryview]]:
        encoded = self._encoded.get(index)
        if encoded is None:
            lo = index * self.PART_TENSORS
            hi = lo + self.PART_TENSORS
            with gc_paused():
                views = [byte_view(t) for t in self.tensors[lo:hi]]  # each keeps its tensor alive
                metas = [
                    TensorMeta(name, t.dtype, tuple(t.shape), v.nbytes)
                    for name, t, v in zip(self.names[lo:hi], self.tensors[lo:hi], views, strict=True)
                ]
            encoded = self._encoded[index] = (metas, views)
        return encoded


class Client:
    """The blocking client: each method runs the ``AsyncClient`` method of the same name on a
    private event loop thread and waits for it (never longer than the options' worst case)."""

    def __init__(self, url: str, options: ClientOptions | None = None) -> None:
        self._worst_case = (options or ClientOptions()).worst_case
        self._deadline = (options or ClientOptions()).deadline
        self._url = url
        self._thread = LoopThread("tensorwire-client")
        self._loop = self._thread.loop
        try:
            self._async = self._call(_make_async(url, options))
        except BaseException:
            self._stop()
            raise
        # A client dropped without close(), or still open at exit, closes its connection (its read
        # loop ends) and stops its loop all the same: nothing is left pending to be destroyed.
        self._finalizer = weakref.finalize(self, _shut, self._thread, self._async, os.getpid())

    @property
    def transport(self) -> str:
        return self._async.transport

    @property
    def url(self) -> str:
        return self._async.url

    @property
    def options(self) -> ClientOptions:
        return self._async.options

    @property
    def resumed_at(self) -> list[int]:
        return self._async.resumed_at

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        # The worst case is a backstop: the client's own timers should have fired long before.
        deadline = self._deadline
        if deadline is None:
            return self._thread.call(coro, self._worst_case, f"a call to {self._url}")
        if deadline.remaining() <= 0:
            coro.close()
            raise deadline.expired()
        try:  # cut short at the deadline: the call is cancelled, and its connection dropped
            return self._thread.call(
                coro, min(self._worst_case, deadline.remaining()), f"a call to {self._url}"
            )
        except TransferTimeout as exc:
            if deadline.remaining() > 0:
                raise
            raise deadline.expired() from exc

    def connect(self) -> Client:
        self._call(self._async.connect())
        return self

    def put(self, name: str, tensor: torch.Tensor, progress: Progress | None = None) -> int:
        return self._call(self._async.put(name, tensor, progress))

    def put_many(self, items: TensorItems, progress: Progress | None = None) -> int:
        return self._call(self._async.put_many(items, progress))

    def get(
        self,
        name: str,
        out: torch.Tensor | None = None,
        progress: Progress | None = None,
        *,
        view: bool = False,
    ) -> torch.Tensor:
        return self._call(self._async.get(name, out, progress, view=view))

    def get_many(
        self,
        names: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
        progress: Progress | None = None,
    ) -> dict[str, torch.Tensor]:
        return self._call(self._async.get_many(names, out, progress))

    def delete(self, name: str) -> None:
        self._call(self._async.delete(name))

    def delete_many(self, names: Sequence[str]) -> int:
        return self._call(self._async.delete_many(names))

    def stat(self, name: str) -> TensorMeta:
        return self._call(self._async.stat(name))

    def list(self, prefix: str = "", limit: int = 0) -> list[TensorMeta]:
        return self._call(self._async.list(prefix, limit))

    def ping(self) -> float:
        return self._call(self._async.ping())

    def close(self) -> None:
        """Close the connection and stop the client's loop (once; later calls do nothing)."""
        self._finalizer()

    def _stop(self) -> None:
        self._thread.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CLOSE_TIMEOUT = 10.0  # closing cancels the read loop and closes a socket: it takes milliseconds


def _shut(thread: LoopThread, client: AsyncClient, pid: int) -> None:
    """``Client.close``, also run when a client is garbage or the interpreter exits (finalize)."""
    if os.getpid() != pid or thread.loop.is_closed():
        return  # a forked child: the loop's thread exists only in the parent
    if thread.on_loop():  # dropped by code running on its own loop: close there, then stop it
        task = thread.loop.create_task(client.close())
        task.add_done_callback(lambda _: thread.loop.stop())
        return
    try:
        with contextlib.suppress(TensorwireError):  # a broken connection closes all the same
            thread.call(client.close(), CLOSE_TIMEOUT, f"closing the client of {client.url}")
    finally:
        thread.stop()


async def _make_async(url: str, options: ClientOptions | None) -> AsyncClient:
    return AsyncClient(url, options)  # built on the client's loop: its locks belong to that loop


def _options(kwargs: dict[str, Any]) -> ClientOptions | None:
    return ClientOptions(**kwargs) if kwargs else None


def connect(url: str, **options: Any) -> Client:
    """A blocking client of the server at ``url`` (``tcp://host:port``, ``shm://127.0.0.1:port``, ...),
    connected now so that a wrong address fails here. ``options`` are ``ClientOptions`` fields."""
    client = Client(url, _options(options))
    try:
        return client.connect()
    except BaseException:
        client.close()
        raise


async def aconnect(url: str, **options: Any) -> AsyncClient:
    """An asyncio client of the server at ``url``, connected now."""
    client = AsyncClient(url, _options(options))
    try:
        return await client.connect()
    except BaseException:
        await client.close()
        raise
