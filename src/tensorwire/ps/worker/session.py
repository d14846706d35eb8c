"""A worker's membership in its job on every server: ``WorkerSession``.

The session is this worker process, as the servers know it: its incarnation (a random secret the
servers bind its rank to at PS_JOIN; every request that acts as the rank carries it, so a second
process with the same RANK, or a forged request under it, is refused), the clock and barrier
generation it has reached, and how often it had to rejoin.

Lifecycle, all on the worker's event loop: ``start`` (heartbeats first, then ``join_all``:
PS_JOIN on every server, PS_INIT where the job is new) -> any number of ``recover`` (a server
dropped this worker: rejoin everywhere and pull) -> ``stop_heartbeats`` and ``leave`` (PS_LEAVE
on every server that can be reached, then every connection closed). The ``Worker`` keeps the
pulls, pushes and barriers; it calls ``recover`` where one of them finds the worker dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable

from tensorwire._aio import cancel_and_wait
from tensorwire.errors import ProtocolError, WorkerDropped
from tensorwire.ps.job import JobConfig
from tensorwire.ps.worker.config import WorkerConfig
from tensorwire.ps.worker.rpc import Sender
from tensorwire.ps.worker.shards import ModelShards
from tensorwire.ps.worker.slot import RETRY_CAP, ServerSlot

__all__ = ["CATCH_UP_TRIES", "WorkerSession"]

log = logging.getLogger("tensorwire.ps.worker")  # the worker's log, as before the session moved here
CATCH_UP_TRIES = 10  # joins that wait for servers a step behind before rolling them back


class WorkerSession:
    """This worker process's membership in its job on every server (see the module doc).

    ``pull_all`` pulls from every serving server and returns the highest version: ``recover``
    calls it once it has rejoined.
    """

    def __init__(
        self,
        config: WorkerConfig,
        slots: list[ServerSlot],
        tensors: ModelShards,
        pull_all: Callable[[], Awaitable[int]],
    ) -> None:
        self.config = config
        self.slots = slots
        # The servers this worker talks to: those the placement gives a shard (a model with fewer
        # elements than there are servers leaves some without).
        self.serving = [slot for slot in slots if slot.shards]
        self._tensors = tensors
        self._pull_all = pull_all
        # A secret of this process: never logged, never shown by a server.
        self.incarnation = secrets.randbits(63) or 1
        self.clock = 0  # pushes made since the last (re)join
        self.barriers = 0  # the last barrier generation this worker passed
        self.rejoins = 0
        self.joined = False
        self._beating: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Heartbeats from the start (a slow first pull must not get it dropped), then join."""
        if self.config.heartbeat > 0:
            self._beating = asyncio.get_running_loop().create_task(self._heartbeats())
        await self.join_all(first=True)

    async def join_all(self, first: bool = False) -> None:
        """Join on every server (initialising the job where there is none). In sync mode this
        worker must be at one step on all of them. Servers of a live job can be a step apart for a
        while (each takes the step when its pushes are in; a failover may hold one back): then it
        leaves those behind, lets them finish that step without it, and joins again. Servers
        restored from checkpoints written a step apart do not move by themselves: after a while the
        ones ahead are rolled back to the older step, which each of them keeps. A server refuses
        that while another worker is live there (that one still moves the job): this one looks
        again, until its timeout."""
        config = JobConfig(self.config.mode, self.config.optimizer, self.config.model).to_json()
        slots = self.serving
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout
        for attempt in itertools.count():
            clocks = await self._join_everywhere(config, first)
            if self.config.mode.kind != "sync" or len(set(clocks)) == 1:
                self.clock = max(clocks)
                return
            behind = [slot for slot in slots if slot.clock < max(clocks)]
            await asyncio.gather(*(self._leave_for_now(slot) for slot in behind))
            if attempt >= CATCH_UP_TRIES:
                if loop.time() >= deadline:
                    raise ProtocolError(f"the servers could not be brought to one step: {clocks}")
                await self._roll_back([slot for slot in slots if slot not in behind], behind, clocks)
            await asyncio.sleep(min(0.05 * (attempt + 1), RETRY_CAP))
        raise AssertionError("unreachable")

    async def _join_everywhere(self, config: str, first: bool) -> list[int]:
        """PS_JOIN on every serving server; the clock each one gives this worker."""
        joined = await asyncio.gather(*(self._join(slot, config, first) for slot in self.serving))
        self.joined = True
        for slot, (clock, seq, _) in zip(self.serving, joined, strict=True):
            slot.joined(clock, seq)
        self.barriers = max(self.barriers, joined[0][2])  # barriers are kept by the first server
        return [slot.clock for slot in self.serving]

    async def _roll_back(self, ahead: list[ServerSlot], behind: list[ServerSlot], clocks: list[int]) -> None:
        """Ask the servers ``ahead`` to go back to the oldest step in ``clocks``, having stepped
        aside there (a server rolls back only with no worker live). A server refuses (WorkerDropped)
        while another worker is live there, or without a checkpoint of that step: then, servers a
        step apart (every worker dropped from one mid-step, while the others took it), those
        ``behind`` take that step empty instead; and the caller looks again."""
        target = min(clocks)
        log.warning("servers stay at steps %s: rolling back to step %d", clocks, target)
        await asyncio.gather(*(self._leave_for_now(slot) for slot in ahead))
        if await self._ask_rollback(ahead, target) or max(clocks) - target != 1:
            return
        log.warning("servers stay at steps %s, with no checkpoint to go back to: step %d is taken empty "
                    "where it is missing", clocks, target)  # fmt: skip
        await self._ask_rollback(behind, target + 1)  # they were left for now: no worker of ours is live

    async def _ask_rollback(self, slots: list[ServerSlot], target: int) -> bool:
        """PS_ROLLBACK to ``target`` on every one of ``slots``; whether all of them did it."""
        answers = await asyncio.gather(
            *(slot.rpc.rollback(target, self.incarnation) for slot in slots), return_exceptions=True
        )
        for answer in answers:
            if isinstance(answer, WorkerDropped):
                log.warning("worker %d: not yet (%s): looking again", self.config.rank, answer)
            elif isinstance(answer, BaseException):
                raise answer
        return not any(isinstance(answer, BaseException) for answer in answers)

    async def _leave_for_now(self, slot: ServerSlot) -> None:
        await slot.rpc.leave(slot.clock, self.incarnation, final=False)

    async def _join(self, slot: ServerSlot, config: str, first: bool) -> tuple[int, int, int]:
        records = [self._tensors.meta(s) for s in slot.shards]
        for attempt in itertools.count(1):
            joined = await slot.rpc.join(slot.clock, self.incarnation, config, records)
            clock, initialized, seq, barrier = joined
            if not first and initialized:
                return clock, seq, barrier
            try:  # the first time, also to check that the server's job is this one
                await self._init(slot, config, with_values=not initialized)
                return clock, seq, barrier
            except WorkerDropped:  # the worker creating the job failed: try again, ours may win
                if attempt == 3:
                    raise
        raise AssertionError("unreachable")

    async def _init(self, slot: ServerSlot, config: str, with_values: bool) -> None:
        """Create the job with this worker's values (the first worker's win), or, without values,
        only check that the server's job is this one (same mode, optimizer and shards)."""
        records = [self._tensors.meta(s) for s in slot.shards]
        data = self._tensors.values(slot.shards) if with_values else []
        await slot.rpc.init(slot.clock, self.incarnation, config, records, data)

    async def recover(self) -> int:
        """A server no longer counts this worker (it restarted, or dropped the worker after missed
        heartbeats): rejoin everywhere and pull the current parameters; their version."""
        log.warning("worker %d was dropped by a server: rejoining", self.config.rank)
        self.rejoins += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout
        while True:
            try:
                await self.join_all()
                return await self._pull_all()
            except WorkerDropped:  # dropped again meanwhile (a failover, a slow machine): once more
                if loop.time() >= deadline:
                    raise
                log.warning("worker %d was dropped again while rejoining: rejoining", self.config.rank)
                await asyncio.sleep(RETRY_CAP)

    async def _heartbeats(self) -> None:
        """Tell every server this worker is alive, each on a connection of its own (a pull waiting
        for a step must not hold up the heartbeat) and on a loop of its own: a server that stopped
        answering holds its beat for the beat's timeout, which must not delay the others' past
        theirs (they would drop this worker too). A server that drops it is rejoined by the next
        push or pull."""
        wait = max(self.config.heartbeat * 4, 1.0)
        options = self.config.options._replace(connect_timeout=wait, request_timeout=wait)
        sender = self._sender()

        async def beat(slot: ServerSlot) -> None:
            while True:
                await slot.beat(sender, self.incarnation, options)
                await asyncio.sleep(self.config.heartbeat)

        try:
            async with asyncio.TaskGroup() as beating:
                for slot in self.serving:
                    beating.create_task(beat(slot))
        finally:
            for slot in self.slots:
                await slot.close_beat()

    async def stop_heartbeats(self) -> None:
        await cancel_and_wait(self._beating)

    async def leave(self) -> None:
        """Leave every server that can be reached now (no retries: the process may be ending),
        then close every connection."""
        try:
            if self.joined:
                sender, timeout = self._sender(), self.config.connect_timeout
                leaving = (slot.leave(sender, self.incarnation, timeout) for slot in self.slots)
                await asyncio.gather(*leaving, return_exceptions=True)
        finally:
            for slot in self.slots:
                await slot.close()

    def _sender(self) -> Sender:
        """Who heartbeats and leaves: the rank itself, never an observer (it neither joins nor
        beats), with no wait of its own."""
        return Sender(self.config.rank, self.config.world_size, job=self.config.job)
