"""The in-memory tensor store a server keeps: bytes, metadata, versions, capacity.

Lifecycle of a put (what the server does, in order):

1. ``reserve(metas)`` checks names and capacity and hands out one writable buffer per tensor
   (reused from a pool when a buffer of that size was freed: fresh pages cost far more than the
   network). Nothing is visible yet.
2. The server receives the payload straight into those buffers and verifies every chunk.
3. ``commit(reservation)`` makes all tensors of the reservation visible at once under one new
   version (after writing them to the data directory, when there is one); ``abort(reservation)``
   returns the buffers instead. A failed or partial transfer is therefore never visible.

Reads pin what they send: ``acquire(names)`` / ``release(entries)``. A buffer replaced or deleted
while pinned goes back to the pool only when its last reader releases it.

What counts against the capacity (``used``): the bytes of stored tensors; a fixed cost per stored
name plus the name's bytes (``entry_cost``: a store of empty tensors is not free, it is Python
objects); reservations of puts in flight; old versions that readers still pin after a delete or
an overwrite (a reply nobody reads must not keep gigabytes alive outside the capacity); and the
scratch a request decodes into (``scratch``); the generations a server keeps (``keep``:
store/generations.py); and what the other parts of the process hold for their peers (``charge``,
by kind: the parameter server's jobs, the gradient exchange), so that ``--capacity`` is one ledger
for the whole process, not one per pool. What another part keeps only for speed (the parameter
server's idle gradient buffers) it lets go of when a put needs the room (``reclaimer``). Besides
bytes, at most ``max_tensors`` names.

The store is thread-safe: the server's event loop calls it directly, and runs what may block on
the disk (``commit`` and ``delete`` with a data directory) through ``call``, on the store's own
disk thread, so that the loop keeps serving others meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tensorwire.errors import CapacityExceeded, InvalidName, KeyNotFound, StoreError
from tensorwire.store.pool import BufferPool
from tensorwire.types import GiB, MiB, TensorMeta
from tensorwire.wire.names import validate_name, validate_prefix

if TYPE_CHECKING:
    from tensorwire.store.shm import SegmentPool

T = TypeVar("T")

# What one stored name costs besides its bytes: its entry, metadata and index slot take ~600 bytes
# of Python objects (measured with tracemalloc), and the allocator's rounding more; 1 KiB keeps a
# million empty tensors from hiding a gigabyte of memory behind "used: 0".
ENTRY_OVERHEAD = 1024
DEFAULT_MAX_TENSORS = 1_000_000


def entry_cost(name: str) -> int:
    """Bytes of capacity a stored name costs besides its tensor's bytes."""
    return ENTRY_OVERHEAD + len(name.encode("utf-8", "surrogatepass"))


@dataclass(eq=False, slots=True)
class Entry:
    """One stored tensor: its metadata (with version) and its bytes."""

    meta: TensorMeta
    data: memoryview
    pins: int = 0
    retired: bool = False
    record: bytes = b""  # ``meta`` as a GET answer carries it, encoded on the first read (store_ops)


@dataclass(eq=False, slots=True)
class Reservation:
    """Buffers handed out by ``reserve`` and not yet committed or aborted."""

    metas: list[TensorMeta] = field(default_factory=list)
    buffers: list[memoryview] = field(default_factory=list)
    nbytes: int = 0  # the tensors' bytes
    names: set[str] = field(default_factory=set)
    done: bool = False
    committing: bool = False
    charge: int = 0  # what it counts against the capacity: nbytes and the cost of its names
    slots: int = 0  # names it may add (not stored when reserved), counted against max_tensors


class TensorStore:
    """Named tensors in memory with an enforced byte capacity and per-put versions."""

    def __init__(
        self,
        capacity: int = 8 * GiB,
        data_dir: Path | str | None = None,
        *,
        max_tensors: int = DEFAULT_MAX_TENSORS,
    ) -> None:
        if max_tensors < 1:
            raise ValueError(f"max_tensors must be at least 1, not {max_tensors}")
        self.capacity = capacity
        self.max_tensors = max_tensors
        self._entries: dict[str, Entry] = {}
        self._stored = 0  # bytes of committed entries
        self._metadata = 0  # entry_cost of committed entries
        self._reserved = 0  # charge of open reservations
        self._slots = 0  # names open reservations may add
        self._pinned = 0  # bytes of replaced or deleted entries that readers still pin
        self._scratch = 0  # requests' decoding buffers (``scratch``)
        self._kept = 0  # charge of reservations kept as generations (``keep``)
        self._kept_names = 0  # their tensors, counted against max_tensors
        self._charged: dict[str, int] = {}  # what other parts of the process hold, by kind (``charge``)
        self._charged_total = 0
        self._reclaimers: dict[object, Callable[[int], None]] = {}  # ``reclaimer``
        self.revision = 0  # the last version handed out; versions come from this one counter
        self._lock = threading.Lock()
        self._disk_lock = threading.Lock()  # orders disk writes the same way as versions
        self._pool: BufferPool | SegmentPool = BufferPool(limit=self.pool_limit, min_size=MiB)
        self._disk = None
        self._disk_thread: ThreadPoolExecutor | None = None
        if data_dir is not None:
            from tensorwire.store.persist import DataDir

            self._disk = DataDir(Path(data_dir))
            self._disk_thread = ThreadPoolExecutor(1, thread_name_prefix="tensorwire-disk")
            self._load()

    # -- introspection -------------------------------------------------------------------------
    @property
    def pool_limit(self) -> int:
        """Most bytes of freed buffers kept for reuse."""
        return min(self.capacity // 4, 2 * GiB)

    @property
    def pool(self) -> BufferPool | SegmentPool:
        return self._pool

    def use_pool(self, pool: SegmentPool) -> None:
        """From now on keep tensors in ``pool``'s memory (shared-memory segments, for ``shm://``);
        the tensors stored so far are copied there once, so every tensor is served the same way."""
        with self._lock:
            if self._pool is pool:
                return
            self._pool = pool
            for entry in self._entries.values():
                if entry.data.nbytes >= pool.min_size and pool.segment_of(entry.data) is None:
                    fresh = pool.allocate(entry.data.nbytes)
                    fresh[:] = entry.data
                    entry.data = fresh

    @property
    def persistent(self) -> bool:
        return self._disk is not None

    @property
    def data_dir(self) -> Path | None:
        """The data directory (``--data-dir``), where generations are kept too (store/generations.py)."""
        return self._disk.path if self._disk is not None else None

    @property
    def used(self) -> int:
        """What counts against the capacity: stored tensors and their names' cost, reservations of
        puts in flight, old versions pinned by readers, and requests' decoding scratch."""
        return (
            self._stored + self._metadata + self._reserved + self._pinned + self._scratch + self._kept
            + self._charged_total
        )  # fmt: skip

    @property
    def stored(self) -> int:
        """Bytes of committed tensors."""
        return self._stored

    @property
    def metadata(self) -> int:
        """Capacity the stored names cost (``entry_cost`` each)."""
        return self._metadata

    @property
    def reserved(self) -> int:
        """Bytes reserved by puts in flight (their tensors' bytes and names' cost)."""
        return self._reserved

    @property
    def pinned(self) -> int:
        """Bytes of deleted or replaced versions that readers still hold (until they release)."""
        return self._pinned

    @property
    def scratch_bytes(self) -> int:
        """Bytes of decoding scratch that requests hold now (``scratch``)."""
        return self._scratch

    @property
    def kept(self) -> int:
        """Bytes held by generations (``keep``), their tensors' and names' cost."""
        return self._kept

    @property
    def charged(self) -> dict[str, int]:
        """What other parts of the process hold against the capacity now, by kind (``charge``)."""
        with self._lock:
            return {kind: n for kind, n in self._charged.items() if n}

    @property
    def room(self) -> int:
        """Bytes that may still be reserved or charged."""
        return self.capacity - self.used

    def __len__(self) -> int:
        return len(self._entries)

    # -- memory the rest of the process holds ---------------------------------------------------
    def charge(self, kind: str, nbytes: int, what: str) -> None:
        """Count ``nbytes`` that another part of the process is about to allocate for a peer
        (``kind`` says who holds them: ``ps.gradients``, ``exchange``, ...; a name from code, never
        from a peer) in ``used``; CapacityExceeded naming ``what`` and --capacity if they do not
        fit, and nothing is counted. ``discharge`` gives them back."""
        with self._lock:
            self._check_room(nbytes, 0, what)
            self._count(kind, nbytes)
            self._pool.trim(self.capacity - self.used)  # buffers kept for reuse make room first

    def check(self, nbytes: int, what: str) -> None:
        """CapacityExceeded (naming ``what`` and --capacity) unless ``nbytes`` more fit now."""
        with self._lock:
            self._check_room(nbytes, 0, what)

    def count(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` (negative: give back) of ``kind`` without a check: memory that was
        checked just before (``check``, on the same thread), or that must be held whatever the
        capacity says (a checkpoint restored at start, a primary's state transfer)."""
        with self._lock:
            self._count(kind, nbytes)
            if nbytes > 0:
                self._pool.trim(self.capacity - self.used)

    def discharge(self, kind: str, nbytes: int) -> None:
        """Give back ``nbytes`` of ``kind`` (never more than is charged)."""
        with self._lock:
            self._count(kind, -min(nbytes, self._charged.get(kind, 0)))

    def reclaimer(self, owner: object, reclaim: Callable[[int], None] | None) -> None:
        """Register (None: forget) what ``owner`` lets go of when a put needs room: ``reclaim(n)``
        frees memory it keeps only for speed while ``n`` more bytes do not fit. It is called without
        the store's lock, from the thread asking for the room."""
        if reclaim is None:
            self._reclaimers.pop(owner, None)
        else:
            self._reclaimers[owner] = reclaim

    def _make_room(self, nbytes: int) -> None:
        """Let the reclaimers free what they keep for speed while ``nbytes`` more do not fit (every
        put asks: where there is room, nothing is allocated)."""
        if nbytes <= self.room or not self._reclaimers:
            return
        for reclaim in list(self._reclaimers.values()):
            if nbytes <= self.room:
                return
            reclaim(nbytes)

    def _count(self, kind: str, nbytes: int) -> None:
        """Move ``kind``'s count by ``nbytes``, never below 0 (lock held)."""
        before = self._charged.get(kind, 0)
        after = self._charged[kind] = max(before + nbytes, 0)
        self._charged_total += after - before

    # -- puts ----------------------------------------------------------------------------------
    def reserve(self, metas: Sequence[TensorMeta], extend: Reservation | None = None) -> Reservation:
        """Buffers for ``metas``; InvalidName / InvalidTensor / CapacityExceeded leave no trace.

        With ``extend``, the buffers are added to that open reservation (a batch that arrives in
        parts) and its new buffers are returned in a reservation of their own; committing
        ``extend`` publishes every part at once.
        """
        seen = extend.names if extend is not None else set()
        before = len(seen)
        for meta in metas:
            validate_name(meta.name)
            meta.check_size()
            seen.add(meta.name)
        if len(seen) - before != len(metas):
            raise InvalidName("a batch names the same tensor twice")
        total = sum(m.nbytes for m in metas)
        charge = total + sum(entry_cost(m.name) for m in metas)
        self._make_room(charge)
        with self._lock:
            if extend is not None and extend.done:  # aborted while this part was being decoded
                raise StoreError("the batch this part belongs to was given up; nothing was stored")
            slots = sum(1 for m in metas if m.name not in self._entries)
            self._check_room(charge, slots)
            self._reserved += charge
            self._slots += slots
            self._pool.trim(self.capacity - self.used)
            floor = self._pool.min_size
            pooled = [self._pool.take(m.nbytes) if m.nbytes >= floor else None for m in metas]
        try:
            pairs = zip(pooled, metas, strict=True)
            buffers = [buf if buf is not None else self._pool.allocate(m.nbytes) for buf, m in pairs]
        except BaseException:  # no room for a new segment, say: the reservation never happened
            with self._lock:
                self._reserved -= charge
                self._slots -= slots
                for buf in pooled:
                    if buf is not None:
                        self._pool.give(buf)
            raise
        if extend is None:
            return Reservation(list(metas), buffers, total, seen, charge=charge, slots=slots)
        extend.metas += metas
        extend.buffers += buffers
        extend.nbytes += total
        extend.charge += charge
        extend.slots += slots
        return Reservation(list(metas), buffers, total, seen, done=True)  # owned by ``extend``

    def admit(self, count: int) -> None:
        """CapacityExceeded unless ``count`` more names could fit (``ENTRY_OVERHEAD`` each): asked
        before a batch's records are decoded, so that a frame of 100,000 records for a store with
        room for ten costs no more than its bytes."""
        with self._lock:
            self._check_room(count * ENTRY_OVERHEAD, 0)

    def _check_room(self, charge: int, slots: int, what: str = "") -> None:
        """CapacityExceeded unless ``charge`` more bytes and ``slots`` more names fit (lock held)."""
        if charge > self.capacity - self.used:
            others = "".join(f", {kind} {n}" for kind, n in sorted(self._charged.items()) if n)
            raise CapacityExceeded(
                f"{what + ' of ' if what else ''}{charge} bytes do not fit: capacity {self.capacity}"
                f" (--capacity), in use {self.used} (tensors {self._stored}, names {self._metadata},"
                f" puts in flight {self._reserved}, pinned by readers {self._pinned}, scratch"
                f" {self._scratch}, generations {self._kept}{others})"
            )
        if slots and len(self._entries) + self._slots + self._kept_names + slots > self.max_tensors:
            raise CapacityExceeded(
                f"{slots} more tensors do not fit: the store holds {len(self._entries)} and puts in"
                f" flight may add {self._slots}, of at most {self.max_tensors} (--max-tensors)"
            )

    @contextlib.contextmanager
    def scratch(self, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` of a request's transient buffers (a compressed chunk being decoded) in
        ``used`` while inside, so that other puts see the memory they take. Never refused: a
        request's scratch is at most twice the chunk it receives into its own reservation, which
        the capacity already admitted (``frame_io.compressed_scratch``)."""
        with self._lock:
            self._scratch += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._scratch -= nbytes

    def hold(self, nbytes: int) -> Callable[[], None]:
        """Count ``nbytes`` of an answer that stays in memory until its peer has read it (a gRPC
        unary answer: grpcio keeps the message until it is sent, however slowly the peer reads) in
        ``used`` (as ``scratch``); CapacityExceeded if they do not fit. Returns the release, which
        may be called more than once."""
        self._make_room(nbytes)
        with self._lock:
            self._check_room(nbytes, 0)
            self._scratch += nbytes
        held = [nbytes]

        def release() -> None:
            with self._lock:
                self._scratch -= held.pop() if held else 0

        return release

    @contextlib.contextmanager
    def holding(self, nbytes: int) -> Iterator[None]:
        """``hold`` for the duration of a block (an answer while it is sent)."""
        release = self.hold(nbytes)
        try:
            yield
        finally:
            release()

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` (``commit``, ``delete``) from the event loop: on the store's disk thread
        when a data directory makes it block (a delete waits for the disk lock of a commit being
        written), so the loop keeps serving others; directly otherwise."""
        if self._disk_thread is None:
            return fn(*args)
        return await asyncio.wrap_future(self._disk_thread.submit(fn, *args))

    def commit(self, res: Reservation) -> int:
        """Make every tensor of ``res`` visible at once under a new version; return the version.

        Once a commit has begun, ``abort`` of the same reservation does nothing: a server whose
        request is cancelled while a worker thread writes the data directory must not hand the
        buffers back to the pool under a commit that is about to publish them.
        """
        with self._lock:
            if res.done or res.committing:
                raise RuntimeError("reservation already committed, being committed or aborted")
            res.committing = True
            if self._disk is None:
                return self._install(res)
        with self._disk_lock:
            with self._lock:
                version = self.revision + 1
                self.revision = version
            try:
                pairs = zip(res.metas, res.buffers, strict=True)
                self._disk.write([(m.with_version(version), b) for m, b in pairs])
            except BaseException:
                res.committing = False
                self.abort(res)
                raise
            with self._lock:
                return self._install(res, version)

    def abort(self, res: Reservation) -> None:
        """Give a reservation's buffers back; nothing of it was ever visible. A no-op once the
        reservation is committed or its commit has begun."""
        with self._lock:
            if res.done or res.committing:
                return
            res.done = True
            self._reserved -= res.charge
            self._slots -= res.slots
            for buf in res.buffers:
                self._pool.give(buf)

    def merge(self, parts: Sequence[Reservation]) -> Reservation:
        """One open reservation holding every buffer of ``parts`` (open, received reservations of
        one multi-part publish), which are done from here: what they counted against the capacity
        moves to it unchanged. InvalidName if two parts name the same tensor (nothing changes)."""
        names: set[str] = set()
        for res in parts:
            if res.done or res.committing:
                raise RuntimeError("reservation already committed, being committed or aborted")
            names |= res.names
        if len(names) != sum(len(res.names) for res in parts):
            raise InvalidName("two parts of one publish name the same tensor")
        merged = Reservation(names=names)
        with self._lock:
            for res in parts:
                merged.metas += res.metas
                merged.buffers += res.buffers
                merged.nbytes += res.nbytes
                merged.charge += res.charge
                merged.slots += res.slots
                res.done = True  # owned by ``merged``
        return merged

    def keep(self, res: Reservation) -> None:
        """Hold a received reservation's buffers outside the named entries (a generation, whose
        tensors are read through its own table): still counted in ``used`` and against
        ``max_tensors``, until ``free_kept``."""
        with self._lock:
            if res.done or res.committing:
                raise RuntimeError("reservation already committed, being committed or aborted")
            res.done = True
            self._reserved -= res.charge
            self._slots -= res.slots
            self._kept += res.charge
            self._kept_names += len(res.metas)

    def free_kept(self, res: Reservation) -> None:
        """A kept reservation is no longer read by anyone: its buffers go back to the pool."""
        with self._lock:
            self._kept -= res.charge
            self._kept_names -= len(res.metas)
            for buf in res.buffers:
                self._pool.give(buf)

    def _install(self, res: Reservation, version: int | None = None) -> int:
        """Publish a reservation (caller holds the lock)."""
        if version is None:
            self.revision += 1
            version = self.revision
        res.done = True
        self._reserved -= res.charge
        self._slots -= res.slots
        for meta, buf in zip(res.metas, res.buffers, strict=True):
            old = self._entries.get(meta.name)
            if old is not None:
                self._drop(old)
            self._entries[meta.name] = Entry(meta.with_version(version), buf)
            self._stored += meta.nbytes
            self._metadata += entry_cost(meta.name)
        return version

    def _drop(self, entry: Entry) -> None:
        """Forget an entry (caller holds the lock); its buffer is reused once no reader pins it,
        and counts as pinned until then."""
        self._stored -= entry.meta.nbytes
        self._metadata -= entry_cost(entry.meta.name)
        entry.retired = True
        if entry.pins == 0:
            self._pool.give(entry.data)
        else:
            self._pinned += entry.data.nbytes

    # -- reads ---------------------------------------------------------------------------------
    def acquire(self, names: Sequence[str]) -> list[Entry]:
        """Pin and return the entries for ``names``; KeyNotFound (nothing pinned) if one is missing."""
        with self._lock:
            entries = [self._lookup(name) for name in names]
            for entry in entries:
                entry.pins += 1
            return entries

    def release(self, entries: Sequence[Entry]) -> None:
        with self._lock:
            for entry in entries:
                entry.pins -= 1
                if entry.pins == 0 and entry.retired:
                    self._pinned -= entry.data.nbytes
                    self._pool.give(entry.data)

    def stat(self, names: Sequence[str]) -> list[TensorMeta]:
        with self._lock:
            return [self._lookup(name).meta for name in names]

    def list(self, prefix: str = "", limit: int = 0) -> list[TensorMeta]:
        """Metadata of the tensors whose names start with ``prefix``, sorted by name."""
        validate_prefix(prefix)
        with self._lock:
            names = sorted(n for n in self._entries if n.startswith(prefix))
            if limit:
                names = names[:limit]
            return [self._entries[n].meta for n in names]

    def _lookup(self, name: str) -> Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise KeyNotFound(f"no tensor named {name!r}")
        return entry

    # -- deletes -------------------------------------------------------------------------------
    def delete(self, names: Sequence[str]) -> int:
        """Remove all of ``names`` or none (KeyNotFound); return how many were removed. With a data
        directory this needs no new disk space (``DataDir.save_revision``), so a full disk can be
        freed through the server; it blocks on the disk, so call it through ``call`` on a loop."""
        with self._disk_lock:
            with self._lock:
                for name in names:
                    self._lookup(name)
            if self._disk is not None:
                self._disk.save_revision(self.revision)  # so a restart never reuses a deleted version
                self._disk.remove(list(names))
            with self._lock:
                for name in dict.fromkeys(names):
                    self._drop(self._entries.pop(name))
        return len(set(names))

    def _load(self) -> None:
        """Fill the store from the data directory (at start, before any client connects)."""
        assert self._disk is not None
        self.revision = self._disk.load_revision()
        for meta, data in self._disk.load():
            self._entries[meta.name] = Entry(meta, data.numpy().data.cast("B"))
            self._stored += meta.nbytes
            self._metadata += entry_cost(meta.name)
            self.revision = max(self.revision, meta.version)
        if self.used > self.capacity:
            raise CapacityExceeded(
                f"data directory holds {self._stored} bytes in {len(self._entries)} tensors"
                f" ({self.used} with their names' cost), more than the capacity {self.capacity} (--capacity)"
            )
        if len(self._entries) > self.max_tensors:
            raise CapacityExceeded(
                f"data directory holds {len(self._entries)} tensors,"
                f" more than {self.max_tensors} (--max-tensors)"
            )
