"""What a parameter server holds in memory for its job, counted against its capacity.

A parameter server's memory is its job's parameters, its optimizer's state (``optimizer``:
momentum, Adam's moments; counted when the job is made, before torch allocates it on the first
step) and what it keeps per push and per pull:

* ``gradients``: the buffers pushes land in, one set of the shards' size per push being received
  or waiting for its sync step (so at most one per live worker at a time), kept for reuse after;
* ``payloads``: a compressed push's payloads, while they are received and decoded;
* ``snapshots``: the copies of the parameters that pulls send from (one per version, more while
  slow readers still send from older ones), with their encodings in the codecs workers pull in.

Each is reserved here before it is allocated. A reservation that the capacity cannot hold is
refused with CapacityExceeded (naming the capacity and ``--capacity``) and nothing changes; the
server first lets go of what it keeps only for speed (free gradient buffers) to make room. The
capacity is the ``ParamServer``'s ``capacity``, ``tensorwire serve --capacity``.
"""

from __future__ import annotations

from tensorwire.errors import CapacityExceeded

KINDS = ("params", "optimizer", "gradients", "payloads", "snapshots")


class Budget:
    """Bytes held, by kind, against one capacity (see the module doc)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.refused = 0  # reservations refused: the capacity was full

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def fits(self, nbytes: int) -> bool:
        return self.total + nbytes <= self.capacity

    def check(self, nbytes: int, what: str) -> None:
        """CapacityExceeded unless ``nbytes`` more fit."""
        if not self.fits(nbytes):
            self.refused += 1
            held = ", ".join(f"{kind} {n}" for kind, n in self.held.items() if n)
            raise CapacityExceeded(
                f"{what} of {nbytes} bytes exceed {self.capacity}, the parameter server's capacity "
                f"(held: {held or 'nothing'}); serve with a larger --capacity"
            )

    def reserve(self, kind: str, nbytes: int, what: str) -> None:
        self.check(nbytes, what)
        self.held[kind] += nbytes

    def release(self, kind: str, nbytes: int) -> None:
        self.held[kind] = max(0, self.held[kind] - nbytes)

    def add(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` without a check: memory a primary checked (a backup's state transfer)."""
        self.held[kind] += nbytes

    def set(self, kind: str, nbytes: int) -> None:
        """What is held of ``kind`` now (a job created or restored: already checked or trusted)."""
        self.held[kind] = nbytes
