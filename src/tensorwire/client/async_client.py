"""``AsyncClient``: the asyncio client of one tensorwire server (``await tensorwire.aconnect(url)``).

Every operation runs under a finite timeout; on a retryable failure (a broken connection, a timeout,
a corrupt chunk) it is retried with exponential backoff on a fresh connection, as long as the
operation is idempotent (``client/retry.py``). ``put`` counts as idempotent (putting the same bytes
twice leaves the same value, at a later version); ``delete`` is retried only when the request
never left.

Which route a put or get takes (direct, staged, striped, resumable, plain; routes.py) is asked of
``Routes``, which asks the transport object (its capabilities, ``transport/base.py``), never the
address scheme; the blocking client's inline path (inline.py) asks the same question.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import torch

from tensorwire import transport as transports
from tensorwire.client import deltas, ranges
from tensorwire.client import generations as gens
from tensorwire.client.batches import Landing, TensorBatch
from tensorwire.client.cache import TensorCache
from tensorwire.client.options import ClientOptions, check, retry_policy, transport_options
from tensorwire.client.retry import retrying
from tensorwire.client.routes import Transfers
from tensorwire.errors import (
    ConnectError,
    InvalidTensor,
    SharedMemoryUnavailable,
)
from tensorwire.logs import event
from tensorwire.transport.base import (
    GenerationViews,
    Transport,
    Viewable,
    as_generational,
    as_ranged_generations,
)
from tensorwire.types import Address, Generation, GenerationManifest, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire.names import validate_name, validate_prefix

T = TypeVar("T")
log = logging.getLogger("tensorwire.client")
Progress = Callable[[int], None]
TensorItems = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class AsyncClient:
    """An asyncio client of one tensorwire server. Safe for concurrent use from one event loop."""

    def __init__(self, url: str, options: ClientOptions | None = None) -> None:
        self.address = Address.parse(url)
        transports.check_scheme(self.address)  # refuse an unknown scheme now, not at first use
        self.options = check(options or ClientOptions())
        self._policy = retry_policy(self.options)
        self._transport: Transport | None = None
        self._open_lock = asyncio.Lock()
        self.cache = TensorCache(self.options.cache_bytes, self.options.cache_lease)
        self.delta_stats = deltas.DeltaStats()  # what reads with base= moved (client/deltas.py)
        # Each put and get of one tensor by its route; ``routes`` says which (routes.py), and the
        # blocking client's inline path asks it too.
        self._transfers = Transfers(self.address, self.options, self._run, self._capable)
        self.routes = self._transfers.routes
        self._closed = False
        self._warned_unverifiable = False

    @property
    def transport(self) -> str:
        """The transport this client's calls take, the address scheme, or "shm" where
        ``prefer_local`` moved to the server's shm:// listener (known once connected)."""
        t = self._transport
        return t.address.scheme if t is not None else self.address.scheme

    @property
    def local_fallback(self) -> str | None:
        """Why ``prefer_local`` did not move this client to shm:// although its server runs on this
        host and serves it (None: it did, or there was nothing to try)."""
        t = self._transport
        return t.local_fallback if t is not None else None

    @property
    def resumed_at(self) -> list[int]:
        """Where each resumed put went on from (bytes the server held, verified, after a break)."""
        return self._transfers.resumed_at

    @property
    def url(self) -> str:
        return str(self.address)

    @property
    def current_transport(self) -> Transport | None:
        """The connection this client holds now (None before the first call, or after close)."""
        return self._transport

    # -- tensors -------------------------------------------------------------------------------
    async def put(
        self, name: str, tensor: torch.Tensor, progress: Progress | None = None, *, attempts: int = 0
    ) -> int:
        """Store ``tensor`` under ``name``; return its new version. A large one (``resumable_bytes``)
        survives broken connections: each retry sends only what the server has not verified.
        ``attempts``: of this put, made already elsewhere (the blocking client's, in its caller's
        own thread), which count against ``retries``."""
        self.cache.invalidate(name)
        return await self._transfers.put(name, tensor, progress, attempts)

    async def put_many(self, items: TensorItems, progress: Progress | None = None) -> int:
        """Store several tensors in one request, atomically (all visible or none, under one new
        version, which is returned). Large batches travel in several frames, pipelined."""
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        if not pairs:
            raise InvalidTensor("put_many needs at least one tensor")
        for name, _ in pairs:
            self.cache.invalidate(name)
        batch = TensorBatch(pairs)
        return await self._run(lambda t: t.put(batch, progress))

    async def get(
        self,
        name: str,
        out: torch.Tensor | None = None,
        progress: Progress | None = None,
        *,
        view: bool = False,
        at: gens.At | None = None,
        verify: bool = False,
        base: gens.At | None = None,
        attempts: int = 0,
    ) -> torch.Tensor:
        """Fetch ``name``. With ``out``, the bytes land in ``out`` in place and ``out`` is returned.
        With ``at`` (a generation number or ``"latest"``), ``name`` (``prefix/key``) is read from
        that generation (``get_many``; ``base=`` as there).

        If the call raises, ``out`` may hold part of the transfer (its contents are unspecified).
        With a cache (``cache_bytes``), an unchanged tensor costs one STAT (or nothing in its lease).
        ``view=True`` (``shm://`` only) returns a read-only tensor over the server's shared pages,
        with no copy: a snapshot of the version read, held for as long as the tensor lives (README,
        "Shared memory"). ``attempts``: as for ``put``.
        """
        if at is not None or verify or base is not None:
            outs = {name: out} if out is not None else None
            return (await self.get_many([name], outs, progress, at=at, verify=verify, base=base))[name]
        if view:
            if out is not None:
                raise InvalidTensor("get(view=True) returns the server's pages; it takes no out=")
            return await self._run(lambda t: _view(t, name))
        if not self.cache.enabled:
            return (await self._transfers.get(name, out, progress, attempts))[0]
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
        tensor, version = await self._transfers.get(name, out, progress)
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

    # -- the other operations --------------------------------------------------------------------
    async def get_many(
        self,
        names: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
        progress: Progress | None = None,
        *,
        at: gens.At | None = None,
        verify: bool = False,
        base: gens.At | None = None,
    ) -> dict[str, torch.Tensor]:
        """Fetch several tensors in one round trip, as one consistent snapshot.

        With ``at`` (a generation number, or ``"latest"``), every name (full names, ``prefix/key``,
        all under one prefix) is read from that one generation, never a mix of two;
        ``GenerationRetired`` if the server no longer keeps it. ``verify=True`` (with ``at``; the
        default ``"latest"`` without) also checks what was read against the generation's chunk
        checksums and root digest (DigestMismatch), one more round trip for its manifest.

        With ``base`` (a generation number) too, ``out`` must hold generation ``base`` of every name
        (contiguous CPU tensors): only what changed since is sent, as per-chunk deltas applied in
        place into ``out`` (README, "Deltas"); a base the server no longer keeps costs the full
        read, and a chunk ``out`` did not hold at ``base`` is fetched again in full
        (``delta_stats``). The result is bit-exact either way.
        """
        if base is not None:
            at = "latest" if at is None else at
            stats = self.delta_stats
            return (
                await deltas.read(self._run, names, out or {}, at=at, base=base, verify=verify, stats=stats)
            )[0]
        if at is not None or verify:
            at = "latest" if at is None else at
            return (await gens.read(self._run, names, at, out, verify))[0]
        # Names are not validated here: a name that could not be stored is simply not found.
        names = list(dict.fromkeys(names))
        landing = Landing(names, dict(out or {}))

        async def op(t: Transport) -> dict[str, torch.Tensor]:
            landing.reset()
            await t.get(names, landing.sink, progress)
            return landing.finish()

        return await self._run(op)

    # -- generations (client/generations.py; README, "Generations") ------------------------------
    async def publish(
        self, prefix: str, tensors: Mapping[str, torch.Tensor], progress: Progress | None = None
    ) -> Generation:
        """Publish ``tensors`` (keys relative to ``prefix``; stored as ``prefix/key``) as the
        prefix's next generation: all visible at once, under the number returned, or none
        (CapacityExceeded, a broken connection: the previous generations stay as they were)."""
        return await gens.publish(self._run, prefix, tensors, progress)

    async def publish_part(
        self,
        prefix: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        txn: bytes,
        index: int,
        count: int,
        timeout: float,
    ) -> Generation:
        """Part ``index`` of ``count`` of one generation of ``prefix`` whose parts come from several
        clients (the ranks of a job; ``txn``: 16 bytes they all name): answered, on every part, with
        the generation once every part is in; else every part gets the error that aborted it
        (``WaitTimeout`` after ``timeout`` seconds, ``PublishAborted`` when a part failed or its
        connection closed) and nothing of it is visible (docs/protocol.md §14.8)."""
        head = wg.PartHead(prefix, txn, index, count, 0)
        return await gens.publish_part(self._run, prefix, tensors, head, timeout)

    @property
    def segment_bytes(self) -> int:
        """Bytes this client's connection copied into or out of shared-memory segments (an shm address;
        puts, parts, gets and reads of generations; what no socket counter sees); 0 otherwise."""
        t = self._transport
        return t.copied_bytes if isinstance(t, GenerationViews) else 0

    async def read_generation(self, prefix: str, at: gens.At = "latest") -> ranges.AsyncGenerationRead:
        """Generation ``at`` of ``prefix`` held for reading byte ranges of its tensors, many in
        flight, each straight into its own buffer (client/ranges.py); ``close`` (or ``async with``)
        lets it go. Over tcp://, tls://, memory:// (leased ranged reads) and shm:// (mapped views)."""
        return await ranges.open_read(self._run, await self._capable(), prefix, gens.at_number(at))

    async def get_range(
        self, name: str, *, at: gens.At, offset: int, length: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Bytes ``offset .. offset + length`` of ``name`` (``prefix/key``) at generation ``at``,
        as a uint8 tensor (``out``, filled in place, when given): with ``manifest``'s chunk
        checksums, what a relay reads and checks one chunk at a time."""
        return await gens.get_range(self._run, name, at, offset, length, out=out)

    async def manifest(self, prefix: str, at: gens.At = "latest") -> GenerationManifest:
        """Generation ``at`` of ``prefix``, each tensor's metadata and its per-chunk checksums."""
        number = gens.at_number(at)
        return await self._run(lambda t: as_ranged_generations(t, "manifest").manifest(prefix, number))

    async def wait(self, prefix: str, after: int = 0, *, timeout: float) -> Generation:
        """The newest generation of ``prefix`` once one after ``after`` exists (at once if one
        does): the server answers when it is published. WaitTimeout (a TransferTimeout) naming the
        prefix and ``after`` if none is within ``timeout`` seconds."""
        if not 0 < timeout < float("inf"):
            raise InvalidTensor(f"wait needs a finite timeout, not {timeout}")
        return await self._run(lambda t: as_generational(t, "wait").wait(prefix, after, timeout))

    async def lease(
        self, prefix: str, number: int, seconds: float = gens.DEFAULT_LEASE_SECONDS
    ) -> gens.AsyncLease:
        """Keep generation ``number`` of ``prefix`` for ``seconds`` (``AsyncLease``: ``async with``
        releases it; ``renew`` extends it); GenerationRetired if it is gone already."""
        lease = gens.AsyncLease(self._run, prefix, number)
        await lease.renew(seconds)
        return lease

    async def drop_generations(self, prefix: str) -> int:
        """Remove every generation of ``prefix`` and the prefix itself (from the server's data
        directory too), freeing its place among the server's ``--max-prefixes``; how many
        generations it had. KeyNotFound if it has none."""
        return await gens.drop(self._run, prefix)

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
        await self._transfers.close()
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
                previous = self._transport.info.store_id if self._transport is not None else 0
                self._transport = await transports.open_transport(
                    self.address, transport_options(self.options)
                )
                if previous and self._transport.info.store_id != previous:
                    self.cache.clear()  # another store now answers here: no copy can be confirmed
            return self._transport

    async def _capable(self) -> Transport:
        """The transport to ask what this client's connections can do: the current one (what it can
        do is what its kind can, so a closed one answers the same), else a new one, with retries."""
        t = self._transport
        return t if t is not None else await self._run(_itself)

    def _run(
        self, op: Callable[[Transport], Awaitable[T]], idempotent: bool = True, attempts: int = 0
    ) -> Awaitable[T]:
        """``op`` on this client's connection, reopened and retried under ``client/retry.py``'s rule
        (the transport bounds every request by ``options.timeout``; ``attempts`` made elsewhere
        count). Not a coroutine itself: the caller awaits ``retrying``'s, one frame less on every
        call."""
        return retrying(op, self._open, self._policy, idempotent=idempotent, attempts=attempts)


async def _itself(t: Transport) -> Transport:
    return t


async def _view(t: Transport, name: str) -> torch.Tensor:
    """``get(name, view=True)``: only a ``Viewable`` transport (shm://) has pages to view."""
    if not isinstance(t, Viewable):
        raise SharedMemoryUnavailable(f"get(view=True) needs an shm:// client, not {t.address}")
    return await t.view(name)
