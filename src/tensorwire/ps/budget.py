"""What a parameter server holds in memory for its jobs, counted against its one capacity.

A parameter server's memory is, for each of its jobs, the job's parameters, its optimizer's state
(``optimizer``: momentum, Adam's moments; counted when the job is made, before torch allocates it
on the first step) and what it keeps per push and per pull:

* ``gradients``: the buffers pushes land in, one set of the shards' size per push being received
  or waiting for its sync step (so at most one per live worker at a time), kept for reuse after;
* ``payloads``: a compressed push's payloads, while they are received and decoded;
* ``snapshots``: the copies of the parameters that pulls send from (one per version, more while
  slow readers still send from older ones), with their encodings in the codecs workers pull in;
* ``restore``: a checkpoint being read beside the job it replaces (PS_ROLLBACK).

The server has one ``Budget`` (its capacity: the ``ParamServer``'s ``capacity``); each job
counts in a ``Budget`` of its own made with ``part_of=`` the server's, so what a job holds is known
(``held``, by kind) and every byte of every job counts against the one capacity. Once the
parameter server joins a server process (``attach``), every count is also made in the process's
one ledger, the tensor store's ``--capacity`` (store/memory.py ``TensorStore.charge``, as
``ps.<kind>``): the store's tensors, the jobs and the gradient exchange share it, so together they
never exceed it. Each is reserved before it is allocated. A reservation that either cannot hold
is refused with CapacityExceeded (naming ``--capacity``) and nothing changes; the server first
lets go of what it keeps only for speed (every job's free gradient buffers: ``reclaimer``,
``make_room``) to make room, also when it is the store that is full; and a put into the store
that needs the room makes them go too (the store's ``reclaimer``: only on the event loop, where
the jobs' state is changed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from tensorwire.errors import CapacityExceeded

KINDS = ("params", "optimizer", "gradients", "payloads", "snapshots", "restore")


class Ledger(Protocol):
    """The process's one capacity, as the parts that count in it see it (store/memory.py
    ``TensorStore``): ``check`` then ``count`` on the event loop's thread, ``room`` to ask."""

    @property
    def room(self) -> int: ...

    def check(self, nbytes: int, what: str) -> None: ...

    def count(self, kind: str, nbytes: int) -> None: ...

    def reclaimer(self, owner: object, reclaim: Callable[[int], None] | None) -> None: ...


class Budget:
    """Bytes held, by kind, against one capacity (see the module doc). ``part_of``: the server's
    budget, which every count of this one is also made in (and checked against)."""

    def __init__(self, capacity: int, part_of: Budget | None = None) -> None:
        self.capacity = capacity
        self.held: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.refused = 0  # reservations refused: the capacity was full
        self._root: Budget = part_of._root if part_of is not None else self
        self._parent = part_of
        self._ledger: Ledger | None = None  # the root's: the process's one capacity (``attach``)
        # What lets go of memory kept for speed when room is needed (the jobs' free buffers).
        self._reclaimers: dict[object, Callable[[int], None]] = {}

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def attach(self, ledger: Ledger) -> None:
        """Count in ``ledger`` too from now on (the server process's store): what the jobs hold
        already (restored from checkpoints at start) is counted there at once, unchecked."""
        root = self._root
        if root._ledger is ledger:
            return
        root._ledger = ledger
        for kind, nbytes in root.held.items():
            ledger.count(f"ps.{kind}", nbytes)
        ledger.reclaimer(root, root._room_for_ledger)

    def _room_for_ledger(self, nbytes: int) -> None:
        """The store needs ``nbytes`` of room (a put): let go of what the jobs keep for speed, if
        asked on the event loop (the jobs' own thread; elsewhere, nothing is let go)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self.make_room(nbytes)

    def fits(self, nbytes: int) -> bool:
        root = self._root
        ledger = root._ledger
        return root.total + nbytes <= root.capacity and (ledger is None or nbytes <= ledger.room)

    def reclaimer(self, owner: object, reclaim: Callable[[int], None] | None) -> None:
        """Register (or, with None, forget) what ``owner`` lets go of when room is needed:
        ``reclaim(n)`` frees what it keeps for speed while ``n`` more bytes do not fit."""
        if reclaim is None:
            self._root._reclaimers.pop(owner, None)
        else:
            self._root._reclaimers[owner] = reclaim

    def make_room(self, nbytes: int) -> None:
        """Let every job go of what it keeps for speed while ``nbytes`` more do not fit."""
        for reclaim in list(self._root._reclaimers.values()):
            if self.fits(nbytes):
                return
            reclaim(nbytes)

    def check(self, nbytes: int, what: str) -> None:
        """CapacityExceeded unless ``nbytes`` more fit."""
        if not self.fits(nbytes):
            self.refused += 1
            if self._parent is not None:
                self._parent.refused += 1
            root = self._root
            if root._ledger is not None and root.total + nbytes <= root.capacity:
                root._ledger.check(nbytes, what)  # the process's --capacity is full: it says by what
            held = ", ".join(f"{kind} {n}" for kind, n in root.held.items() if n)
            raise CapacityExceeded(
                f"{what} of {nbytes} bytes exceed {root.capacity}, the parameter server's capacity "
                f"(held by its jobs: {held or 'nothing'}); serve with a larger --capacity"
            )

    def reserve(self, kind: str, nbytes: int, what: str) -> None:
        self.check(nbytes, what)
        self.add(kind, nbytes)

    def release(self, kind: str, nbytes: int) -> None:
        self.add(kind, -min(nbytes, self.held[kind]))

    def add(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` without a check: memory a primary checked (a backup's state transfer)."""
        self.held[kind] += nbytes
        if self._parent is not None:
            self._parent.add(kind, nbytes)
        elif self._ledger is not None:
            self._ledger.count(f"ps.{kind}", nbytes)

    def set(self, kind: str, nbytes: int) -> None:
        """What is held of ``kind`` now (a job created or restored: already checked or trusted)."""
        self.add(kind, nbytes - self.held[kind])

    def clear(self) -> None:
        """The job ended: nothing of it is held any more."""
        for kind in KINDS:
            self.set(kind, 0)
