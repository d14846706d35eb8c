"""Who is in a parameter-server job: one record per worker (rank), and who may act as it.

A ``Member`` is a rank's clock, liveness, push marks (the last push sequence number applied and
its answer, so a resent push is answered, not applied again) and the session holding the rank:
the worker process's random incarnation, sent with its PS_JOIN. Every push, pull, heartbeat and
leave of the rank carries it; a request under a rank with another (or no) incarnation is refused
before it changes anything (``member``, ``refuse_identity``), counted and logged.

A joining worker starts at the current step (sync) or the slowest clock (``joining_clock``).
A PS_JOIN is resent when its connection breaks (the worker's ``ServerSlot.call``; under load,
after two missed heartbeats), and the first one may have been admitted: a join again from the
session holding a rank it joined for the first time, before that worker pushed anything, is that
join resent and answered as the first one (``_resent_first_join``), not taken for a rejoin, which
would start it a step later and let the step it was in be taken without it.

Barriers (PS_BARRIER): a worker's n-th ``Worker.barrier()`` is generation n, noted as its
``barrier`` (replicated); generation n is released once every rank of the world has joined and
every live worker is at n or beyond (``barrier_released``): a worker that leaves or is dropped no
longer holds the others, and one that joins starts at the generation released (the join's answer).

A rank is free again when its worker leaves, or, with heartbeat checks on, when it has not been
heard from for ``heartbeat_timeout``: the watchdog drops such workers (on the primary only: a
backup learns drops from it) so sync steps go on without them, and they may rejoin.

Lifecycle: ``Members`` is made with its job (ps/server/jobs.py); ``admit`` starts the watchdog (when
heartbeats are checked), ``stop`` ends it when the job ends or the server closes. The watchdog
asks ``primary()`` whether to act and hands each silent worker to ``drop`` (the server
replicates the drop and makes it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NoReturn

from tensorwire._aio import cancel_and_wait
from tensorwire.errors import ProtocolError, WorkerDropped
from tensorwire.logs import event
from tensorwire.ps.job import Job
from tensorwire.ps.server.gradients import Gradients
from tensorwire.server.core import Request
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

log = logging.getLogger("tensorwire.ps")


@dataclass(eq=False)
class Member:
    """One worker (rank) of the job."""

    clock: int = 0  # pushes recorded (sync) or applied (async, ssp)
    live: bool = True
    read_clock: int = 0  # the slowest live clock when this worker last pulled
    pushing: bool = False
    seq: int = 0  # the highest push sequence number applied: a resend at or below it is a duplicate
    incarnation: int = 0  # which process holds the rank (PS_JOIN's seq field)
    last_reply: bytes = b""  # the answer to push ``seq``, sent again to a resend of it
    heard: float = field(default_factory=time.monotonic)  # its last request or heartbeat
    barrier: int = 0  # the last barrier generation it arrived at (PS_BARRIER)
    # Left for good (its final PS_LEAVE), not merely dropped or stepped aside: a dropped worker
    # (missed heartbeats under load, a restart) may come back, and its job must still be there.
    finished: bool = False
    # Admitted as a rank new to the job (no record of it before): a rejoin is not. With ``seq``
    # still 0 (nothing pushed since), a join again from its session is that first join resent.
    first: bool = False


class Members:
    """The job's workers by rank (see the module doc)."""

    def __init__(
        self,
        job: Job,
        gradients: Gradients,
        heartbeat_timeout: float,
        *,
        primary: Callable[[], bool],
        drop: Callable[[int], Awaitable[None]],
    ) -> None:
        self._job = job
        self._gradients = gradients
        # A live worker not heard from (request or heartbeat) for this long is dropped from the
        # job, so that sync steps go on without it; 0 turns it off.
        self.heartbeat_timeout = heartbeat_timeout
        self.workers: dict[int, Member] = {}
        self.identity_refused = 0  # requests under a rank that another session holds
        self.dropped = 0  # workers dropped for missed heartbeats
        self.released = 0  # the last barrier generation every live worker reached
        self._primary = primary
        self._drop = drop
        self._watchdog: asyncio.Task[None] | None = None

    def live(self) -> list[int]:
        return sorted(w for w, state in self.workers.items() if state.live)

    def slowest(self) -> int:
        """The slowest live worker's clock; 0 while some of the ``world`` have not joined yet."""
        if len(self.workers) < self._job.world:
            return 0
        clocks = [state.clock for state in self.workers.values() if state.live]
        return min(clocks) if clocks else 0

    def finished(self) -> bool:
        """Every rank of the world joined once and has left for good (a final leave; a dropped
        worker may rejoin): the job's work is done."""
        world = self._job.world
        return bool(world) and len(self.workers) >= world and all(s.finished for s in self.workers.values())

    def barrier_released(self) -> int:
        """The last barrier generation released (see the module doc), brought up to date: every
        live worker is at it or beyond, and every rank of the world has joined."""
        live = [s.barrier for s in self.workers.values() if s.live]
        if live and len(self.workers) >= self._job.world:
            self.released = max(self.released, min(live))
        return self.released

    def not_at_barrier(self, generation: int) -> str:
        """Who keeps barrier ``generation`` from being released, for an error message."""
        late = sorted(w for w, s in self.workers.items() if s.live and s.barrier < generation)
        missing = [w for w in range(min(self._job.world, len(self.workers) + 16)) if w not in self.workers]
        said = f"live workers not there yet: {', '.join(map(str, late[:16])) or 'none'}"
        return said + (f"; never joined: {', '.join(map(str, missing[:16]))}" if missing else "")

    def session_of(self, head: wps.PsHead) -> Member | None:
        """The live worker of ``head.worker``, if ``head`` comes from the session that joined with
        it (its incarnation in ``seq``)."""
        state = self.workers.get(head.worker)
        live = state is not None and state.live and state.incarnation == head.seq
        return state if live else None

    # -- joining and leaving --------------------------------------------------------------------
    def rank_free(self, head: wps.PsHead) -> bool:
        before = self.workers.get(head.worker)
        return before is None or not before.live or before.incarnation == head.seq or not self._alive(before)

    def check_rank_free(self, head: wps.PsHead) -> None:
        if not self.rank_free(head):
            raise ProtocolError(
                f"rank {head.worker} is held by another live process (a second worker with the same RANK?); "
                "it is freed when that one leaves or misses its heartbeats"
            )

    def joining_clock(self, worker: int) -> int:
        """Where a joining worker starts. Sync: the current step, or the next one when pushes for
        the current one are in already (that step goes on without the newcomer: its workers need
        not wait, and servers that are a step apart agree on where the newcomer starts). A rank
        joining for the first time always starts at the current step: no step is taken before
        every rank joined, so that step waits for it anyway, and a worker started a little later
        than the others (a slow machine) must not shift the whole run by a step."""
        job = self._job
        if not job.mode or job.mode.kind != "sync":
            return self.slowest()
        pending = self._gradients.pending.get(job.step)
        rejoin = worker in self.workers
        return job.step + 1 if rejoin and pending is not None and pending.grads else job.step

    def admit(self, head: wps.PsHead) -> bytes:
        """Make ``head.worker`` live at the current step (sync) or the slowest clock; the answer.
        The caller wakes the waiters (a join may open a gate)."""
        self._job.note_world(head.world)
        before = self.workers.get(head.worker)  # a rejoin keeps its push marks: resends stay duplicates
        if before is not None and self._resent_first_join(before, head):
            before.heard = time.monotonic()
            log.info("worker %d resent its join of job %s: answered as the first one, at clock %d",
                     head.worker, self._job.id, before.clock)  # fmt: skip
            return wps.encode_join_reply(
                before.clock, self._job.config is not None, before.seq, self.barrier_released()
            )
        clock = self.joining_clock(head.worker)
        seq, reply = (before.seq, before.last_reply) if before else (0, b"")
        released = self.barrier_released()
        barrier = max(before.barrier if before else 0, released)
        self.workers[head.worker] = Member(
            clock,
            read_clock=clock,
            seq=seq,
            last_reply=reply,
            incarnation=head.seq,
            barrier=barrier,
            first=before is None,
        )
        log.info(
            "worker %d joined job %s at clock %d (live: %s)", head.worker, self._job.id, clock, self.live()
        )
        self.start_watchdog()
        return wps.encode_join_reply(clock, self._job.config is not None, seq, released)

    @staticmethod
    def _resent_first_join(before: Member, head: wps.PsHead) -> bool:
        """Whether ``head`` is the PS_JOIN that admitted ``before`` sent again (its answer was lost
        with its connection, and ``ServerSlot.call`` resent it): the same session, still live, which
        joined the job for the first time and has pushed nothing since. Such a worker is where it
        was admitted (sync: step 0, which no step passes without its push), and stays there."""
        return before.live and before.first and before.seq == 0 and before.incarnation == head.seq

    def left(self, worker: int, why: str, *, final: bool = False) -> None:
        """``worker`` is no longer live; ``final``: it left for good (its last PS_LEAVE)."""
        state = self.workers[worker]
        state.live = False
        state.finished = final
        self.barrier_released()  # it no longer holds a barrier up
        log.info("worker %d of job %s %s at clock %d (live: %s)", worker, self._job.id, why, state.clock,
                 self.live())  # fmt: skip

    # -- who may act as a rank ------------------------------------------------------------------
    def member(self, request: Request, head: wps.PsHead, incarnation: int) -> Member:
        """The live worker sending ``head``, checked to be the session that joined with that rank
        (``incarnation``) before anything changes; WorkerDropped (rejoin) if it is not one."""
        state = self.workers.get(head.worker)
        if state is None or not state.live:
            why = (
                "it left or was dropped"
                if state is not None
                else "it has not joined since this server started"
            )
            raise WorkerDropped(f"worker {head.worker} is not part of job {self._job.id!r} ({why}): rejoin")
        if incarnation != state.incarnation:
            self.refuse_identity(request, head, incarnation)
        state.heard = time.monotonic()
        return state

    def refuse_identity(self, request: Request, head: wps.PsHead, incarnation: int) -> NoReturn:
        """A request under a rank that another session (worker process) joined with: a second
        process with the same RANK, an old one that was replaced, or a forgery. Refused, counted,
        logged (the first time and then at every power of two, so a flood does not flood the log)."""
        self.identity_refused += 1
        what = Opcode(request.header.opcode).name
        if self.identity_refused & (self.identity_refused - 1) == 0:
            event(log, logging.WARNING, "refused a request under a rank another session holds", request=what,
                  worker=head.worker, peer=request.peer, refused_so_far=self.identity_refused)  # fmt: skip
        if not incarnation:
            raise ProtocolError(
                f"{what} as worker {head.worker} carries no incarnation (the session that joined "
                "with that rank): a worker older than this server? Use the same tensorwire on both"
            )
        raise WorkerDropped(
            f"{what} as worker {head.worker} refused: that rank belongs to another session (a worker "
            "process that joined with it); this one is not part of the job: rejoin"
        )

    # -- heartbeats -----------------------------------------------------------------------------
    def _alive(self, state: Member) -> bool:
        """Whether a live worker was heard from lately (always, without heartbeat checks: then
        only its PS_LEAVE frees the rank)."""
        return not self.heartbeat_timeout or time.monotonic() - state.heard < self.heartbeat_timeout

    def start_watchdog(self) -> None:
        if self.heartbeat_timeout > 0 and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_heartbeats())

    async def _watch_heartbeats(self) -> None:
        """Drop live workers not heard from for ``heartbeat_timeout``: sync steps go on without them."""
        while True:
            await asyncio.sleep(self.heartbeat_timeout / 4)
            if not self._primary():  # workers beat to the primary; a backup learns drops from it
                continue
            now = time.monotonic()
            silent = [w for w, s in self.workers.items() if s.live and not s.pushing
                      and now - s.heard > self.heartbeat_timeout]  # fmt: skip
            for worker in silent:
                await self._drop(worker)

    async def stop(self) -> None:
        await cancel_and_wait(self._watchdog)
        self._watchdog = None
