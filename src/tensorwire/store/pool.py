"""Reuse of large receive buffers.

On this class of machine a fresh page costs several times a network copy (page faults run at
well under 1 GB/s while loopback TCP runs at ~3 GB/s), so a server that allocates a new buffer for
every put of a large tensor is bound by the page-fault rate. Buffers freed by overwrites and
deletes wait here, by exact size, for the next put of that size. The pool is bounded and the store
counts it against its capacity (it trims the pool before refusing a put).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


class BufferPool:
    """Free buffers by exact byte size, at most ``limit`` bytes in all."""

    def __init__(self, limit: int, min_size: int) -> None:
        self.limit = limit
        self.min_size = min_size
        self.held = 0
        self.fresh = 0  # bytes of new buffers of the pool's sizes handed out: what costs page faults
        self._free: defaultdict[int, list[memoryview]] = defaultdict(list)

    def allocate(self, nbytes: int) -> memoryview:
        """A new buffer, for a put the pool had none for."""
        if nbytes >= self.min_size:
            self.fresh += nbytes
        return allocate_private(nbytes)

    def take(self, nbytes: int) -> memoryview | None:
        """A free buffer of exactly ``nbytes``, or None."""
        free = self._free.get(nbytes)
        if not free:
            return None
        self.held -= nbytes
        buf = free.pop()
        if not free:
            del self._free[nbytes]
        return buf

    def give(self, buf: memoryview) -> None:
        """Keep ``buf`` for reuse if it is large enough to be worth it and the pool has room."""
        size = buf.nbytes
        if size < self.min_size or self.held + size > self.limit or buf.readonly:
            return
        self._free[size].append(buf)
        self.held += size

    def trim(self, room: int) -> None:
        """Drop buffers until the pool holds at most ``room`` bytes (room left under capacity)."""
        while self.held > max(room, 0) and self._free:
            size = max(self._free)
            self.take(size)


def allocate_private(nbytes: int) -> memoryview:
    """A new writable buffer of this process's own memory."""
    if nbytes < 1 << 16:
        return memoryview(bytearray(nbytes))  # cheapest for small tensors; the zero fill is tiny
    # numpy.empty maps large buffers lazily (no zero fill, unlike bytearray) and is 64-byte aligned.
    return np.empty(nbytes, dtype=np.uint8).data.cast("B")
