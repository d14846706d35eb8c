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

Counting (``--capacity``): every buffer of the pool counts in the store's ``used`` as
``rdma.engine`` (STATUS ``store.charged``) from the moment ``take`` allocates it until a reclaim
frees it, in use or idle. A get's copy needs room of its own (CapacityExceeded naming
``--capacity``, once the idle buffers are reclaimed). A put's landing buffer may use the room its
own reservation counts and needs room only for its rounding up: the tensor's bytes exist twice
until the commit copies them, so a put the capacity admits is not refused for its landing, and
``used`` may pass the capacity by the landing buffers of puts admitted so (as decoding scratch
does). Every later request sees them: a reservation that does not fit has the idle buffers
reclaimed first (the store's ``reclaimer``, on the event loop), and is refused if it still does
not fit. Giving a buffer back counts nothing, so it cannot fail (and set off a reclaim) however
full the store is. Buffers come in sizes that waste less than a quarter of a request (64 KiB and
up, four sizes per power of two; a request uses a prefix of one), at most ``limit`` bytes in all.
In RDMA mode none of this is needed: deregistering a buffer revokes the NIC's access to it, so the
server registers reservations and copies directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tensorwire.errors import LimitExceeded
from tensorwire.store import TensorStore
from tensorwire.store.pool import allocate_private
from tensorwire.transport.rdma_engine import Engine, address_of, prefault
from tensorwire.types import KiB

log = logging.getLogger("tensorwire.rdma")
MIN_SIZE = 64 * KiB
KIND = "rdma.engine"  # what the store's ledger calls the idle buffers
QUICK_CUT = 0.25  # seconds a reclaim the store asks for (on the event loop) waits for the cut


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` gets: at least ``MIN_SIZE``, else ``nbytes`` rounded
    up to an eighth of the next power of two (four sizes per power of two: less than a quarter of
    the request is wasted, and a request of the same size reuses the buffer)."""
    if nbytes <= MIN_SIZE:
        return MIN_SIZE
    step = 1 << ((nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


class EngineMemory:
    """The engine's memory in TCP mode (module doc): ``take`` a buffer, ``give`` it back. Used
    on the server's event loop only."""

    def __init__(self, engine: Engine, store: TensorStore, limit: int) -> None:
        self.engine, self.store, self.limit = engine, store, limit
        self._owned: dict[int, memoryview] = {}  # address -> every buffer of the pool (all charged)
        self._free: dict[int, list[memoryview]] = {}  # size -> idle buffers
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        self.held = 0  # bytes of every buffer of the pool: what is charged as ``KIND``
        self.idle = 0
        self.reclaims = 0
        store.reclaimer(self, self._make_room)

    async def take(self, nbytes: int, admitted: int = 0) -> memoryview:
        """A buffer of at least ``nbytes`` (its first ``nbytes``), counted in the store's ``used``
        until a reclaim frees it. ``admitted``: room the caller's own reservation already counts
        for the same bytes (a put's landing buffer; module doc), which the buffer may use; only the
        rest needs room of its own. LimitExceeded when the pool holds ``limit`` bytes in requests
        under way, CapacityExceeded (naming --capacity) when the rest does not fit even once the
        idle buffers are reclaimed."""
        size = size_class(nbytes)
        free = self._free.get(size)
        if free:
            buf = free.pop()
            self.idle -= size
            return buf[:nbytes]  # counted already
        own = max(size - admitted, 0)
        if self.held + size > self.limit or (self.idle and self.store.room < own):
            await self.reclaim()
        if self.held + size > self.limit:
            raise LimitExceeded(
                f"the engine's memory (TCP mode) holds {self.held} bytes; {size} more would pass its bound "
                f"of {self.limit} bytes (RdmaService max_engine_memory)"
            )
        self.store.check(own, "the transfer engine's memory (TCP mode)")
        buf = allocate_private(size)
        prefault(buf)  # bytes land in it: fault its pages in once, not under the engine's locks
        self.store.count(KIND, size)
        self._owned[address_of(buf)] = buf
        self.held += size
        return buf[:nbytes]

    def give(self, view: memoryview) -> None:
        """A buffer ``take`` handed out, back for reuse (still charged: never handed to the
        allocator but by a reclaim, see the module doc). Charges nothing, so it cannot fail."""
        buf = self._owned.get(address_of(view))
        if buf is not None:
            self._free.setdefault(buf.nbytes, []).append(buf)
            self.idle += buf.nbytes

    def _idle(self) -> list[memoryview]:
        """Every idle buffer, taken out of reach of ``take`` (still charged until freed)."""
        dying = [b for buffers in self._free.values() for b in buffers]
        self._free, self.idle = {}, 0
        return dying

    def _settle(self, dying: list[memoryview], cut: bool) -> None:
        """Free ``dying`` and discharge them (the connections are cut), or keep them idle (they
        are not)."""
        if not cut:
            log.warning("the engine's connections did not close: %d idle buffers stay", len(dying))
            for buf in dying:
                self.give(buf)
            return
        self.reclaims += 1
        for buf in dying:
            if self._owned.pop(address_of(buf), None) is not None:  # not if the pool closed meanwhile
                self.held -= buf.nbytes
                self.store.discharge(KIND, buf.nbytes)

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
            if asyncio.get_running_loop() is self._loop and self.idle:
                dying = self._idle()
                self._settle(dying, self.engine.closed or self.engine.cut_connections(QUICK_CUT))

    async def close(self) -> None:
        """The engine closed (its connections with it): everything goes back."""
        self.store.reclaimer(self, None)
        self.store.discharge(KIND, self.held)
        self._owned, self._free = {}, {}
        self.held = self.idle = 0


__all__ = ["KIND", "MIN_SIZE", "EngineMemory", "size_class"]
