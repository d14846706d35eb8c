"""Where each replica set's primary is, as the coordinator says (``Worker(coordinator=...)``):
``LeaderWatch``.

Without it a worker finds a slot's primary by trying its replicas in turn (ps/worker/slot.py: a
broken connection or NOT_PRIMARY moves to the next one), and a request stuck on a primary that was
cut off waits until heartbeats give up on it. With servers whose leadership an etcd lease decides
(``ps serve --coordinator``), the worker watches each slot's leader key too (a watch, not a poll):
when it names another replica, the slot moves there at once, and a request waiting on the old one
fails and is resent to the new one (exactly once, by sequence number). So a worker partitioned
from an old primary moves within about one lease ttl, whatever its own timeouts.

The slot's name in the coordinator is the server's to say (``ps stats``: ``coordinator.slot``);
a replica set whose servers have no coordinator is not watched. The watch is a hint on top of the
replica rotation, never the only way to a primary: a coordinator this worker cannot reach is
logged and counted (``errors``), and the rotation goes on as without it.

Lifecycle: made with the worker's slots and coordinator; ``start`` (on the worker's loop, once the
worker has joined) learns the slots' names and starts one watch each; ``close`` ends them and
closes the coordinator.
"""

from __future__ import annotations

import asyncio
import logging

from tensorwire._aio import cancel_and_wait
from tensorwire.coordinator import Coordinator
from tensorwire.errors import TensorwireError
from tensorwire.ps.worker.slot import ServerSlot

log = logging.getLogger("tensorwire.ps.worker")
COORDINATOR_ENV = "TENSORWIRE_COORDINATOR"  # the coordinator's URL, when Worker(coordinator=) is not given
_RETRY = 1.0  # seconds before a failed watch is opened again


class LeaderWatch:
    """The coordinator's word on each replica set's primary (see the module doc)."""

    def __init__(self, coordinator: Coordinator, slots: list[ServerSlot]) -> None:
        self.coordinator = coordinator
        self.slots = [slot for slot in slots if len(slot.replicas) > 1]
        self.followed = 0  # moves made on the coordinator's word
        self.errors = 0  # watches that failed (the coordinator unreachable)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Learn each replica set's slot name from its server, and watch its leader."""
        loop = asyncio.get_running_loop()
        for slot in self.slots:
            name = await self._name_of(slot)
            if name is not None:
                self._tasks.append(loop.create_task(self._watch(slot, name)))

    @staticmethod
    async def _name_of(slot: ServerSlot) -> str | None:
        doc = await slot.rpc.stats(slot.clock)
        led = doc.get("coordinator")
        name = led.get("slot") if isinstance(led, dict) else None
        if not isinstance(name, str):
            log.warning("%s has no coordinator: its primary is found by trying its replicas", slot.name)
            return None
        return name

    async def _watch(self, slot: ServerSlot, name: str) -> None:
        while True:
            try:
                async for leader in self.coordinator.watch(name):
                    if leader is not None and await slot.follow(leader.address):
                        self.followed += 1
            except TensorwireError as exc:
                self.errors += 1
                log.info("watching slot %s's leader failed (%s); trying again", name, exc)
            await asyncio.sleep(_RETRY)

    async def close(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks = []
        await self.coordinator.close()
