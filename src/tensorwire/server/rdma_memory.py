"""The memory a server's transfer engine is told about, in the engine's TCP mode.

An engine in TCP mode checks a peer's request against the registered buffers once, when the
request's head arrives, and then moves its bytes for as long as the peer sends them, even after
the buffer is unregistered (``transport/rdma_sockets.py``). A peer that sends a head and stalls,
or a client whose transfer outlived its own timeout, can therefore write into that memory later,
whatever it has become meanwhile: a stored tensor, another request's buffer, memory handed back
to the allocator. So in TCP mode the engine is only ever told about memory of this pool, which is
never anything else:

* a put lands in one of its buffers; after RDMA_END unregisters it, the bytes are copied into the
  store's reservation and the chunk checksums are checked *there*, on the bytes that are stored;
* a get's copy is one of its buffers;
* a buffer given back waits here for the next request; it goes back to the allocator only in a
  reclaim, after the connections peers opened to the engine's data port are cut (every request
  that could still touch it ends with its connection; a peer's engine reconnects for its next
  transfer, after one failed try that the client retries).

Counting (``--capacity``): a buffer in use is counted by its request (a put's reservation, a get's
hold); an idle one is charged to the store as ``rdma.engine`` (STATUS ``store.charged``). Idle
buffers are memory kept for speed: a put that does not fit has them reclaimed first (the store's
``reclaimer``, on the event loop), and so does an idle buffer the capacity has no room for.
Buffers come in power-of-two sizes (64 KiB and up; a request uses a prefix of one), at most
``limit`` bytes in all. In RDMA mode none of this is needed: deregistering a buffer revokes the
NIC's access to it, so the server registers reservations and copies directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tensorwire.errors import CapacityExceeded, LimitExceeded
from tensorwire.store import TensorStore
from tensorwire.store.pool import allocate_private
from tensorwire.transport.rdma_engine import Engine, address_of, prefault
from tensorwire.types import KiB

log = logging.getLogger("tensorwire.rdma")
MIN_SIZE = 64 * KiB
KIND = "rdma.engine"  # what the store's ledger calls the idle buffers
QUICK_CUT = 0.25  # seconds a reclaim the store asks for (on the event loop) waits for the cut


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` gets: the next power of two, at least ``MIN_SIZE``."""
    return max(MIN_SIZE, 1 << (max(nbytes, 1) - 1).bit_length())


class EngineMemory:
    """The engine's memory in TCP mode (module doc): ``take`` a buffer, ``give`` it back. Used
    on the server's event loop only."""

    def __init__(self, engine: Engine, store: TensorStore, limit: int) -> None:
        self.engine, self.store, self.limit = engine, store, limit
        self._owned: dict[int, memoryview] = {}  # address -> every buffer of the pool
        self._free: dict[int, list[memoryview]] = {}  # size -> idle buffers, charged to the store
        self._uncounted: list[memoryview] = []  # idle, no room to charge them: to be reclaimed
        self._reclaiming: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        self.held = 0  # bytes of every buffer of the pool
        self.idle = 0
        self.reclaims = 0
        store.reclaimer(self, self._make_room)

    async def take(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes`` (its first ``nbytes``), counted by the caller's request
        from now; LimitExceeded when the pool holds ``limit`` bytes in requests under way."""
        size = size_class(nbytes)
        free = self._free.get(size)
        if free:
            buf = free.pop()
            self.idle -= size
            self.store.discharge(KIND, size)
            return buf[:nbytes]
        if self.held + size > self.limit:
            await self.reclaim()
        if self.held + size > self.limit:
            raise LimitExceeded(
                f"the engine's memory (TCP mode) holds {self.held} bytes; {size} more would pass its bound "
                f"of {self.limit} bytes (RdmaService max_engine_memory)"
            )
        buf = allocate_private(size)
        prefault(buf)  # bytes land in it: fault its pages in once, not under the engine's locks
        self._owned[address_of(buf)] = buf
        self.held += size
        return buf[:nbytes]

    def give(self, view: memoryview) -> None:
        """A buffer ``take`` handed out, back for reuse and charged here (never handed to the
        allocator but by a reclaim: see the module doc)."""
        buf = self._owned.get(address_of(view))
        if buf is None:
            return
        try:
            self.store.charge(KIND, buf.nbytes, "the transfer engine's idle memory")
        except CapacityExceeded:
            self._uncounted.append(buf)
            if self._reclaiming is None or self._reclaiming.done():
                self._reclaiming = asyncio.get_running_loop().create_task(self.reclaim())
            return
        self._free.setdefault(buf.nbytes, []).append(buf)
        self.idle += buf.nbytes

    def _idle(self) -> list[memoryview]:
        """Every idle buffer, taken out of reach of ``take`` (and of the store's count)."""
        dying = [*self._uncounted, *(b for buffers in self._free.values() for b in buffers)]
        self.store.discharge(KIND, self.idle)
        self._uncounted, self._free, self.idle = [], {}, 0
        return dying

    def _settle(self, dying: list[memoryview], cut: bool) -> None:
        """Free ``dying`` (the connections are cut), or keep them idle (they are not)."""
        if not cut:
            log.warning("the engine's connections did not close: %d idle buffers stay", len(dying))
            for buf in dying:
                self.give(buf)
            return
        self.reclaims += 1
        for buf in dying:
            del self._owned[address_of(buf)]
            self.held -= buf.nbytes

    async def reclaim(self) -> None:
        """Hand the idle buffers back to the allocator once no peer's request can touch them. They
        were unregistered before this began, so only a request on a connection open now can: the
        connections to the engine's data port are cut (off the event loop) and, once the engine
        has closed them, the buffers are freed. If some stay open, nothing is."""
        dying = self._idle()
        if dying:
            cut = self.engine.closed or await asyncio.get_running_loop().run_in_executor(
                None, self.engine.cut_connections
            )
            self._settle(dying, cut)

    def _make_room(self, nbytes: int) -> None:
        """The store's reclaimer: a put does not fit, the idle buffers go (on the event loop only,
        where the pool lives; the cut is waited for at most ``QUICK_CUT``)."""
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self._loop and (self._free or self._uncounted):
                dying = self._idle()
                self._settle(dying, self.engine.closed or self.engine.cut_connections(QUICK_CUT))

    async def close(self) -> None:
        """The engine closed (its connections with it): everything goes back."""
        self.store.reclaimer(self, None)
        if self._reclaiming is not None:
            self._reclaiming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reclaiming
        self.store.discharge(KIND, self.idle)
        self._owned, self._free, self._uncounted = {}, {}, []
        self.held = self.idle = 0


__all__ = ["KIND", "MIN_SIZE", "EngineMemory", "size_class"]
