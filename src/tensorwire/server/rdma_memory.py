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
* a buffer given back waits here for the next request; it goes back to the allocator only in
  ``reclaim``, after the connections peers opened to the engine's data port are cut (every request
  that could still touch it ends with its connection; a peer's engine reconnects for its next
  transfer, after one failed try that the client retries).

Counting (``--capacity``): a buffer in use is counted by its request (a put's reservation of the
same size, a get's hold); an idle one by the pool (``TensorStore.hold``). When the capacity has no
room for an idle buffer, the idle buffers are reclaimed. Buffers come in power-of-two sizes (64 KiB
and up; a request uses a prefix of one), at most ``limit`` bytes in all. In RDMA mode none of this
is needed: deregistering a buffer revokes the NIC's access to it, so the server registers
reservations and copies directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from tensorwire.errors import CapacityExceeded, LimitExceeded
from tensorwire.store import TensorStore
from tensorwire.store.pool import allocate_private
from tensorwire.transport.rdma_engine import Engine, address_of, prefault
from tensorwire.types import KiB

log = logging.getLogger("tensorwire.rdma")
MIN_SIZE = 64 * KiB


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` gets: the next power of two, at least ``MIN_SIZE``."""
    return max(MIN_SIZE, 1 << (max(nbytes, 1) - 1).bit_length())


class EngineMemory:
    """The engine's memory in TCP mode (module doc): ``take`` a buffer, ``give`` it back."""

    def __init__(self, engine: Engine, store: TensorStore, limit: int) -> None:
        self.engine, self.store, self.limit = engine, store, limit
        self._owned: dict[int, memoryview] = {}  # address -> every buffer of the pool
        self._free: dict[int, list[memoryview]] = {}  # size -> idle buffers
        self._counted: dict[int, Callable[[], None]] = {}  # address -> the hold of an idle buffer
        self._uncounted: list[memoryview] = []  # idle, no room to count them: to be reclaimed
        self._reclaiming: asyncio.Task[None] | None = None
        self.held = 0  # bytes of every buffer of the pool
        self.idle = 0
        self.reclaims = 0

    async def take(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes`` (its first ``nbytes``), counted by the caller's request
        from now; LimitExceeded when the pool holds ``limit`` bytes in requests under way."""
        size = size_class(nbytes)
        free = self._free.get(size)
        if free:
            buf = free.pop()
            self.idle -= size
            self._counted.pop(address_of(buf))()
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
        """A buffer ``take`` handed out, back for reuse and counted here (never handed to the
        allocator but by ``reclaim``: see the module doc)."""
        buf = self._owned.get(address_of(view))
        if buf is None:
            return
        try:
            self._counted[address_of(buf)] = self.store.hold(buf.nbytes)
        except CapacityExceeded:
            self._uncounted.append(buf)
            self._reclaim_soon()
            return
        self._free.setdefault(buf.nbytes, []).append(buf)
        self.idle += buf.nbytes

    def _reclaim_soon(self) -> None:
        if self._reclaiming is None or self._reclaiming.done():
            self._reclaiming = asyncio.get_running_loop().create_task(self.reclaim())

    async def reclaim(self) -> None:
        """Hand the idle buffers back to the allocator once no peer's request can touch them. They
        were unregistered before this began, so only a request on a connection open now can: the
        connections to the engine's data port are cut (off the event loop) and, once the engine
        has closed them, the buffers are freed. If some stay open, nothing is."""
        dying = [*self._uncounted, *(b for buffers in self._free.values() for b in buffers)]
        if not dying:
            return
        self._uncounted, self._free, self.idle = [], {}, 0  # nobody takes them while connections are cut
        loop = asyncio.get_running_loop()
        if not (self.engine.closed or await loop.run_in_executor(None, self.engine.cut_connections)):
            log.warning("the engine's connections did not close: %d idle buffers stay", len(dying))
            for buf in dying:
                self._counted.pop(address_of(buf), lambda: None)()
                self.give(buf)
            return
        self.reclaims += 1
        for buf in dying:
            self._counted.pop(address_of(buf), lambda: None)()
            del self._owned[address_of(buf)]
            self.held -= buf.nbytes

    async def close(self) -> None:
        """The engine closed (its connections with it): everything goes back."""
        if self._reclaiming is not None:
            self._reclaiming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reclaiming
        for release in self._counted.values():
            release()
        self._owned, self._free, self._counted, self._uncounted = {}, {}, {}, []
        self.held = self.idle = 0


__all__ = ["MIN_SIZE", "EngineMemory", "size_class"]
