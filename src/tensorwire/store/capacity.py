"""The capacity ledger of a ``TensorStore``: every byte and name that counts against ``--capacity``
and ``--max-tensors``, and the checks that refuse what does not fit.

What counts (``used``): the bytes of stored tensors (``stored``); a fixed cost per stored name plus
the name's bytes (``metadata``, ``entry_cost``: a store of empty tensors is not free, it is Python
objects); reservations of puts in flight (``reserved``); old versions that readers still pin after
a delete or an overwrite (``pinned``: a reply nobody reads must not keep gigabytes alive outside
the capacity); the scratch a request decodes into and answers that wait for a slow peer
(``scratch``); the generations a server keeps (``kept``: store/generations.py); and what the other
parts of the process hold for their peers (``charge``, by kind: the parameter server's jobs, the
gradient exchange), so that ``--capacity`` is one ledger for the whole process, not one per pool.
What another part keeps only for speed (the parameter server's idle gradient buffers) it lets go
of when a put needs the room (``reclaimer``). Besides bytes, at most ``max_tensors`` names.

Every allocation a peer can cause is charged here before it is made: this is the one place that
says no. The ledger shares its store's lock (``lock``): the store changes its table of entries and
these counters together, under one lock, so that a check and the charge that follows it cannot be
split by another thread. Methods whose names say "lock held" are called by the store with it held.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from tensorwire.errors import CapacityExceeded

# What one stored name costs besides its bytes: its entry, metadata and index slot take ~600 bytes
# of Python objects (measured with tracemalloc), and the allocator's rounding more; 1 KiB keeps a
# million empty tensors from hiding a gigabyte of memory behind "used: 0".
ENTRY_OVERHEAD = 1024
DEFAULT_MAX_TENSORS = 1_000_000


def entry_cost(name: str) -> int:
    """Bytes of capacity a stored name costs besides its tensor's bytes."""
    return ENTRY_OVERHEAD + len(name.encode("utf-8", "surrogatepass"))


class Capacity:
    """The counters of what a store and the rest of its process hold, against ``capacity`` bytes
    and ``max_tensors`` names. ``names()`` is how many names the store holds now (lock held);
    ``trim(room)`` lets the store's pool of freed buffers shrink to ``room`` (lock held)."""

    def __init__(
        self,
        capacity: int,
        max_tensors: int,
        *,
        lock: threading.Lock,
        names: Callable[[], int],
        trim: Callable[[int], None],
    ) -> None:
        if max_tensors < 1:
            raise ValueError(f"max_tensors must be at least 1, not {max_tensors}")
        self.capacity = capacity
        self.max_tensors = max_tensors
        self.lock = lock
        self._names = names
        self._trim = trim
        self.stored = 0  # bytes of committed entries
        self.metadata = 0  # entry_cost of committed entries
        self.reserved = 0  # charge of open reservations
        self.slots = 0  # names open reservations may add
        self.pinned = 0  # bytes of replaced or deleted entries that readers still pin
        self.scratch_bytes = 0  # requests' decoding buffers and held answers (``scratch``, ``hold``)
        self.kept = 0  # charge of reservations kept as generations (``TensorStore.keep``)
        self.kept_names = 0  # their tensors, counted against max_tensors
        self._charged: dict[str, int] = {}  # what other parts of the process hold, by kind (``charge``)
        self._charged_total = 0
        self._reclaimers: dict[object, Callable[[int], None]] = {}  # ``reclaimer``

    @property
    def used(self) -> int:
        """What counts against the capacity: stored tensors and their names' cost, reservations of
        puts in flight, old versions pinned by readers, requests' scratch, generations kept and what
        the rest of the process charged."""
        return (
            self.stored + self.metadata + self.reserved + self.pinned + self.scratch_bytes + self.kept
            + self._charged_total
        )  # fmt: skip

    @property
    def room(self) -> int:
        """Bytes that may still be reserved or charged."""
        return self.capacity - self.used

    @property
    def charged(self) -> dict[str, int]:
        """What other parts of the process hold against the capacity now, by kind (``charge``)."""
        with self.lock:
            return {kind: n for kind, n in self._charged.items() if n}

    # -- memory the rest of the process holds ---------------------------------------------------
    def charge(self, kind: str, nbytes: int, what: str) -> None:
        """Count ``nbytes`` that another part of the process is about to allocate for a peer
        (``kind`` says who holds them: ``ps.gradients``, ``exchange``, ...; a name from code, never
        from a peer) in ``used``; CapacityExceeded naming ``what`` and --capacity if they do not
        fit, and nothing is counted. ``discharge`` gives them back."""
        with self.lock:
            self.check_room(nbytes, 0, what)
            self._count(kind, nbytes)
            self._trim(self.room)  # buffers kept for reuse make room first

    def check(self, nbytes: int, what: str) -> None:
        """CapacityExceeded (naming ``what`` and --capacity) unless ``nbytes`` more fit now."""
        with self.lock:
            self.check_room(nbytes, 0, what)

    def count(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` (negative: give back) of ``kind`` without a check: memory that was
        checked just before (``check``, on the same thread), or that must be held whatever the
        capacity says (a checkpoint restored at start, a primary's state transfer)."""
        with self.lock:
            self._count(kind, nbytes)
            if nbytes > 0:
                self._trim(self.room)

    def discharge(self, kind: str, nbytes: int) -> None:
        """Give back ``nbytes`` of ``kind`` (never more than is charged)."""
        with self.lock:
            self._count(kind, -min(nbytes, self._charged.get(kind, 0)))

    def _count(self, kind: str, nbytes: int) -> None:
        """Move ``kind``'s count by ``nbytes``, never below 0 (lock held)."""
        before = self._charged.get(kind, 0)
        after = self._charged[kind] = max(before + nbytes, 0)
        self._charged_total += after - before

    def reclaimer(self, owner: object, reclaim: Callable[[int], None] | None) -> None:
        """Register (None: forget) what ``owner`` lets go of when a put needs room: ``reclaim(n)``
        frees memory it keeps only for speed while ``n`` more bytes do not fit. It is called without
        the store's lock, from the thread asking for the room."""
        if reclaim is None:
            self._reclaimers.pop(owner, None)
        else:
            self._reclaimers[owner] = reclaim

    def make_room(self, nbytes: int) -> None:
        """Let the reclaimers free what they keep for speed while ``nbytes`` more do not fit (every
        put asks: where there is room, nothing is allocated). Without the lock."""
        if nbytes <= self.room or not self._reclaimers:
            return
        for reclaim in list(self._reclaimers.values()):
            if nbytes <= self.room:
                return
            reclaim(nbytes)

    # -- checks --------------------------------------------------------------------------------
    def admit(self, count: int) -> None:
        """CapacityExceeded unless ``count`` more names could fit (``ENTRY_OVERHEAD`` each): asked
        before a batch's records are decoded, so that a frame of 100,000 records for a store with
        room for ten costs no more than its bytes."""
        with self.lock:
            self.check_room(count * ENTRY_OVERHEAD, 0)

    def check_room(self, charge: int, slots: int, what: str = "") -> None:
        """CapacityExceeded unless ``charge`` more bytes and ``slots`` more names fit (lock held)."""
        if charge > self.capacity - self.used:
            others = "".join(f", {kind} {n}" for kind, n in sorted(self._charged.items()) if n)
            raise CapacityExceeded(
                f"{what + ' of ' if what else ''}{charge} bytes do not fit: capacity {self.capacity}"
                f" (--capacity), in use {self.used} (tensors {self.stored}, names {self.metadata},"
                f" puts in flight {self.reserved}, pinned by readers {self.pinned}, scratch"
                f" {self.scratch_bytes}, generations {self.kept}{others})"
            )
        held = self._names()
        if slots and held + self.slots + self.kept_names + slots > self.max_tensors:
            raise CapacityExceeded(
                f"{slots} more tensors do not fit: the store holds {held} and puts in"
                f" flight may add {self.slots}, of at most {self.max_tensors} (--max-tensors)"
            )

    # -- a request's transient memory ----------------------------------------------------------
    @contextlib.contextmanager
    def scratch(self, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` of a request's transient buffers (a compressed chunk being decoded) in
        ``used`` while inside, so that other puts see the memory they take. Never refused: a
        request's scratch is at most twice the chunk it receives into its own reservation, which
        the capacity already admitted (``frame_io.compressed_scratch``)."""
        with self.lock:
            self.scratch_bytes += nbytes
        try:
            yield
        finally:
            with self.lock:
                self.scratch_bytes -= nbytes

    def hold(self, nbytes: int) -> Callable[[], None]:
        """Count ``nbytes`` of an answer that stays in memory until its peer has read it (a gRPC
        unary answer: grpcio keeps the message until it is sent, however slowly the peer reads) in
        ``used`` (as ``scratch``); CapacityExceeded if they do not fit. Returns the release, which
        may be called more than once."""
        self.make_room(nbytes)
        with self.lock:
            self.check_room(nbytes, 0)
            self.scratch_bytes += nbytes
        held = [nbytes]

        def release() -> None:
            with self.lock:
                self.scratch_bytes -= held.pop() if held else 0

        return release

    @contextlib.contextmanager
    def holding(self, nbytes: int) -> Iterator[None]:
        """``hold`` for the duration of a block (an answer while it is sent)."""
        release = self.hold(nbytes)
        try:
            yield
        finally:
            release()
