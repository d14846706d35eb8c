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

What counts against the capacity (``used``) is kept by the store's ``Capacity`` ledger
(store/capacity.py, ``ledger``): stored tensors and their names' cost, puts in flight, versions
readers pin, requests' scratch, generations kept, and what the rest of the process charges. The
store moves its counters as entries come and go, under the one lock they share, and offers the
ledger's operations (``charge``, ``hold``, ``scratch``, ...) under its own name, as the rest of the
process has always called them.

The store is thread-safe: the server's event loop calls it directly, and runs what may block on
the disk (``commit`` and ``delete`` with a data directory) through ``call``, on the store's own
disk thread, so that the loop keeps serving others meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, overload

from tensorwire.errors import CapacityExceeded, InvalidName, KeyNotFound, StoreError
from tensorwire.store.capacity import DEFAULT_MAX_TENSORS, ENTRY_OVERHEAD, Capacity, entry_cost
from tensorwire.store.pool import BufferPool
from tensorwire.types import GiB, MiB, TensorMeta
from tensorwire.wire.names import validate_name, validate_prefix

if TYPE_CHECKING:
    from tensorwire.store.shm import SegmentPool

T = TypeVar("T")

# The ledger's constants, importable from here as before.
__all__ = ["DEFAULT_MAX_TENSORS", "ENTRY_OVERHEAD", "Entry", "Reservation", "TensorStore", "entry_cost"]


class Entry:
    """One stored tensor: its metadata (with version) and its bytes.

    One object for the cyclic garbage collector to walk per stored tensor, not four: the metadata
    is kept as plain fields (``meta`` builds the ``TensorMeta``: a named tuple stays tracked for
    ever, a plain one would not) and a small tensor's bytes as their ``bytearray``, which the
    collector does not track (``data`` views it; a view and its buffer are two tracked objects).
    With 300,000 small tensors stored, each full collection (every ~100,000 tensors put) paused
    the server's loop for up to 255-320 ms; 113-164 ms now. Larger and shared-memory buffers stay
    views.
    """

    __slots__ = ("_bytes", "dtype", "name", "nbytes", "pins", "record", "retired", "shape", "version")
    _bytes: bytearray | memoryview

    def __init__(self, meta: TensorMeta, data: memoryview, version: int | None = None) -> None:
        self.name, self.dtype, self.shape, self.nbytes, self.version = meta
        if version is not None:
            self.version = version
        self.data = data
        self.pins = 0
        self.retired = False
        self.record = b""  # ``meta`` as a GET answer carries it, encoded on its first read (store_ops)

    @property
    def meta(self) -> TensorMeta:
        return TensorMeta(self.name, self.dtype, self.shape, self.nbytes, self.version)

    @property
    def data(self) -> memoryview:
        kept = self._bytes
        return memoryview(kept) if isinstance(kept, bytearray) else kept

    @data.setter
    def data(self, view: memoryview) -> None:
        under = view.obj
        if isinstance(under, bytearray) and view.nbytes == len(under) and view.format == "B":
            self._bytes = under  # the whole bytearray: kept as it is, untracked
        else:
            self._bytes = view

    @property
    def payload(self) -> bytearray | memoryview:
        """The bytes as kept, for a GET to send (``Request.reply`` takes them as they are): ``data``
        without a new view. Views of 10,000 tensors alive while a ``get_many`` is sent brought
        collections enough to double the server's CPU per tensor (2.2-3.2 -> 5.0-5.4 µs)."""
        return self._bytes


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


class _Figure:
    """A count of the store's ``ledger`` (``Capacity``), read as the store's own attribute of the
    same name (``store.used``): the rest of the process asks the store, the ledger keeps it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, store: None, owner: type | None = None) -> _Figure: ...
    @overload
    def __get__(self, store: TensorStore, owner: type | None = None) -> int: ...
    def __get__(self, store: TensorStore | None, owner: type | None = None) -> int | _Figure:
        return self if store is None else int(getattr(store.ledger, self.name))


class TensorStore:
    """Named tensors in memory with an enforced byte capacity and per-put versions."""

    def __init__(
        self,
        capacity: int = 8 * GiB,
        data_dir: Path | str | None = None,
        *,
        max_tensors: int = DEFAULT_MAX_TENSORS,
    ) -> None:
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()  # the entries and the ledger's counters change together
        self.ledger = Capacity(
            capacity, max_tensors, lock=self._lock, names=self._entries.__len__, trim=self._trim
        )
        # The ledger's operations, under the names the rest of the process calls them by.
        self.charge = self.ledger.charge
        self.check = self.ledger.check
        self.count = self.ledger.count
        self.discharge = self.ledger.discharge
        self.reclaimer = self.ledger.reclaimer
        self.admit = self.ledger.admit
        self.scratch = self.ledger.scratch
        self.hold = self.ledger.hold
        self.holding = self.ledger.holding
        self.revision = 0  # the last version handed out; versions come from this one counter
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

    # The ledger's figures (store/capacity.py says what each counts), read as the store's own.
    capacity = _Figure()
    max_tensors = _Figure()
    used = _Figure()
    stored = _Figure()
    metadata = _Figure()
    reserved = _Figure()
    pinned = _Figure()
    scratch_bytes = _Figure()
    kept = _Figure()
    room = _Figure()

    @property
    def charged(self) -> dict[str, int]:
        return self.ledger.charged

    def __len__(self) -> int:
        return len(self._entries)

    def _trim(self, room: int) -> None:
        """Let the pool of freed buffers shrink to ``room`` (the ledger asks, lock held)."""
        self._pool.trim(room)

    # -- puts ----------------------------------------------------------------------------------
    def reserve(self, metas: Sequence[TensorMeta], extend: Reservation | None = None) -> Reservation:
        """Buffers for ``metas``; InvalidName / InvalidTensor / CapacityExceeded leave no trace.

        With ``extend``, the buffers are added to that open reservation (a batch that arrives in
        parts) and its new buffers are returned in a reservation of their own; committing
        ``extend`` publishes every part at once.
        """
        seen = extend.names if extend is not None else set()
        before = len(seen)
        total = charge = 0
        for meta in metas:  # one pass: the loop runs once per tensor of every batch
            name = meta.name
            validate_name(name)
            meta.check_size()
            seen.add(name)
            total += meta.nbytes
            charge += entry_cost(name)
        if len(seen) - before != len(metas):
            raise InvalidName("a batch names the same tensor twice")
        charge += total
        ledger = self.ledger
        ledger.make_room(charge)
        with self._lock:
            if extend is not None and extend.done:  # aborted while this part was being decoded
                raise StoreError("the batch this part belongs to was given up; nothing was stored")
            slots = sum(1 for m in metas if m.name not in self._entries)
            ledger.check_room(charge, slots)
            ledger.reserved += charge
            ledger.slots += slots
            self._pool.trim(ledger.room)
            floor = self._pool.min_size
            pooled = [self._pool.take(m.nbytes) if m.nbytes >= floor else None for m in metas]
        try:
            pairs = zip(pooled, metas, strict=True)
            buffers = [buf if buf is not None else self._pool.allocate(m.nbytes) for buf, m in pairs]
        except BaseException:  # no room for a new segment, say: the reservation never happened
            with self._lock:
                ledger.reserved -= charge
                ledger.slots -= slots
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
            self.ledger.reserved -= res.charge
            self.ledger.slots -= res.slots
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
            ledger = self.ledger
            ledger.reserved -= res.charge
            ledger.slots -= res.slots
            ledger.kept += res.charge
            ledger.kept_names += len(res.metas)

    def free_kept(self, res: Reservation) -> None:
        """A kept reservation is no longer read by anyone: its buffers go back to the pool."""
        with self._lock:
            self.ledger.kept -= res.charge
            self.ledger.kept_names -= len(res.metas)
            for buf in res.buffers:
                self._pool.give(buf)

    def _install(self, res: Reservation, version: int | None = None) -> int:
        """Publish a reservation (caller holds the lock)."""
        if version is None:
            self.revision += 1
            version = self.revision
        res.done = True
        ledger = self.ledger
        ledger.reserved -= res.charge
        ledger.slots -= res.slots
        entries = self._entries
        for meta, buf in zip(res.metas, res.buffers, strict=True):
            old = entries.get(meta.name)
            if old is not None:
                self._drop(old)
            entries[meta.name] = Entry(meta, buf, version)
        ledger.stored += res.nbytes
        ledger.metadata += res.charge - res.nbytes  # what reserve charged for the names
        return version

    def _drop(self, entry: Entry) -> None:
        """Forget an entry (caller holds the lock); its buffer is reused once no reader pins it,
        and counts as pinned until then."""
        self.ledger.stored -= entry.nbytes
        self.ledger.metadata -= entry_cost(entry.name)
        entry.retired = True
        if entry.pins == 0:
            self._give_back(entry)
        else:
            self.ledger.pinned += entry.nbytes

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
                    self.ledger.pinned -= entry.nbytes
                    self._give_back(entry)

    def _give_back(self, entry: Entry) -> None:
        """A forgotten entry's buffer, to the pool (caller holds the lock). A small tensor's own
        bytearray is no pool's to keep: it is not wrapped in a view only to be turned away."""
        kept = entry.payload
        if isinstance(kept, memoryview):
            self._pool.give(kept)

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
            self.ledger.stored += meta.nbytes
            self.ledger.metadata += entry_cost(meta.name)
            self.revision = max(self.revision, meta.version)
        if self.used > self.capacity:
            raise CapacityExceeded(
                f"data directory holds {self.stored} bytes in {len(self._entries)} tensors"
                f" ({self.used} with their names' cost), more than the capacity {self.capacity} (--capacity)"
            )
        if len(self._entries) > self.max_tensors:
            raise CapacityExceeded(
                f"data directory holds {len(self._entries)} tensors,"
                f" more than {self.max_tensors} (--max-tensors)"
            )
