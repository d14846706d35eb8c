"""How workers come and go in a parameter server's jobs: PS_INIT, PS_JOIN, PS_LEAVE, PS_BARRIER,
PS_END, PS_ROLLBACK, heartbeat drops, and the same changes made by a backup.

``Lifecycle`` serves these requests over the server's ``Jobs`` (ps/server/jobs.py) and ``Replica``. Each
request names its job (wire/ps.py: the job id after the head). A join or an init may open a new
job (``Jobs.open``: at most ``--max-jobs``), and a job it opened but left empty is dropped again
(``Jobs.prune``), so a refused request leaves no trace. The job's own checks come first: a worker
whose rank or world does not fit, or that runs another model, mode or optimizer than the job of
its id, is refused naming each difference (``Job.check_worker``, ``Job.check_same_job``), before
it is admitted or waits for anything.

Who may join or initialise a job: a client offering the job's token (ps/job.py ``Job.check_owner``:
the first join admitted into the job, once its rank and model checks pass, makes its token the
job's, ``Job.claim``; a refused request, or a PS_INIT, claims nothing); a PS_INIT only from the
session that joined with its rank. Who may end a job (PS_END, ``tensorwire ps end JOB``): a
client offering the job's token or the servers' operator token (``ps serve --operator-token-file``),
any client the server admits for a job started without a token (or not claimed yet); while the job
has live workers only with ``force``. Who may roll a job back (PS_ROLLBACK): only one of its
workers, from the session that joined with its rank, after stepping aside, and only while no
worker is live there (one that is still moves the job; the asker is told to rejoin and look again).
Every change is replicated first (ps/server/replica.py), in the server's one order of changes (a JOIN
carries the job's owner); a backup makes it with the same code (``make_change``).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time

import torch

from tensorwire.errors import NotPrimary, ProtocolError, ReplicationRefused, WorkerDropped
from tensorwire.logs import event
from tensorwire.ps.exchange.server import GradientExchange, frame_session
from tensorwire.ps.job import OPEN, JobConfig, check_records, check_replicated, described_job, token_digest
from tensorwire.ps.server import checkpoint, replication
from tensorwire.ps.server.jobs import JobRun, Jobs
from tensorwire.ps.server.replica import Replica
from tensorwire.server.core import Request
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.tensors import byte_view

log = logging.getLogger("tensorwire.ps")
LAST_WORKER_LEFT = "its last worker left"  # why a job ended, in its record (PS_STATS ``ended``)


class Lifecycle:
    """The requests that open, join, leave and end jobs (see the module doc)."""

    def __init__(
        self, jobs: Jobs, replica: Replica, exchange: GradientExchange, *, operator: str | None = None
    ) -> None:
        self.jobs = jobs
        self._replica = replica
        self._exchange = exchange
        # The digest of the servers' operator token (``ps serve --operator-token-file``): it may end
        # any job. None: no operator; a job's own token (or none, for an open job) ends it.
        self._operator = token_digest(operator.encode()) if operator else None
        self.say_open = False  # log a job opened without a token (the server admits only some clients)

    def run_of(self, head: wps.PsHead) -> JobRun:
        """The job a worker's request names; WorkerDropped (rejoin) if this server has none of it."""
        if not head.job:
            raise ProtocolError("this parameter-server request names no job (an empty job id)")
        run = self.jobs.get(head.job)
        if run is None:
            raise WorkerDropped(
                f"job {head.job!r} is not on this server (it ended, or the server restarted): rejoin"
            )
        return run

    def _opened(self, head: wps.PsHead) -> JobRun:
        if not head.job:
            raise ProtocolError("a worker must name its job (an empty job id)")
        return self.jobs.open(head.job)

    # -- initialising ---------------------------------------------------------------------------
    async def on_init(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        config = JobConfig.from_json(wps.decode_config(request.meta))
        metas = wm.decode_records(request.meta)
        credential = wps.decode_credential(request.meta)
        request.meta.done()
        # Without data it only checks that the server's job is the worker's (a rejoining worker).
        check_only = request.header.data_len == 0 and any(m.nbytes for m in metas)
        check_records(metas, None if check_only else request.header.data_len)
        run = self._opened(head)
        try:
            run.job.check_owner(credential, "PS_INIT")  # compared only: a PS_INIT claims nothing
            await self._init(run, request, head, config, metas, check_only=check_only)
        finally:
            self.jobs.prune(run)

    async def _init(
        self,
        run: JobRun,
        request: Request,
        head: wps.PsHead,
        config: JobConfig,
        metas: list[TensorMeta],
        *,
        check_only: bool,
    ) -> None:
        job = run.job
        if check_only and job.config is None and not run.initializing:
            raise ProtocolError(f"PS_INIT without values, but job {run.id!r} has no parameters here yet")
        job.check_worker(head)
        run.members.member(request, head, head.seq)  # the session that joined with the rank: seq
        if job.config is None and not run.initializing:
            copies = 1 + config.optimizer.state_copies
            run.budget.check(copies * request.header.data_len, "the job's parameters and optimizer state")
            await self._create(run, request, head, config, metas)
            await request.reply(wps.encode_init_reply(True, job.step))
            return
        await request.skip()  # someone else's values won: this worker pulls them
        with request.waiting():
            ready = lambda: job.config is not None or not run.initializing  # noqa: E731
            await run.consistency.wait(ready, head, "the job's parameters to be initialised")
        if job.config is None:  # the worker creating it failed: this one may try again
            raise WorkerDropped("the worker that was creating the job failed: initialise it again")
        job.check_same_job(config, metas)
        await request.reply(wps.encode_init_reply(False, job.step))

    async def _create(
        self, run: JobRun, request: Request, head: wps.PsHead, config: JobConfig, metas: list[TensorMeta]
    ) -> None:
        run.initializing = True
        try:
            values = [torch.empty(m.numel, dtype=m.dtype) for m in metas]
            await request.receive([byte_view(v) for v in values])
            async with self._replica.in_order():
                run.consistency.check_open()
                body = wps.encode_config(config.to_json()) + wm.encode_records(metas)
                await self._replica.replicate(
                    replication.Change.CREATE, head, body, [byte_view(v) for v in values]
                )
                run.job.install(head.world, config, metas, values)
        finally:
            run.initializing = False
            run.consistency.notify()

    # -- joining and leaving --------------------------------------------------------------------
    async def on_join(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        described = described_job(request.meta)
        credential = wps.decode_credential(request.meta) if described is not None else b""
        request.meta.done()
        if not head.seq:
            raise ProtocolError("PS_JOIN needs the worker process's incarnation (random, not 0) in seq")
        self.jobs.check_not_ended(head.job, head.seq)
        run = self._opened(head)
        try:
            run.job.check_owner(credential, "PS_JOIN")  # refused before it waits for anything
            await self._join(run, request, head, described, credential)
        finally:
            self.jobs.prune(run)

    def _claim(self, run: JobRun, credential: bytes) -> None:
        """An admitted join's token becomes an unclaimed job's (ps/job.py ``Job.claim``)."""
        if run.job.claim(credential) and run.job.owner == OPEN and self.say_open:
            event(log, logging.WARNING, "a job was started without a job token: every client this server "
                  "admits may join or end it ($TENSORWIRE_JOB_TOKEN gives it one)", job=run.id)  # fmt: skip

    async def _join(
        self,
        run: JobRun,
        request: Request,
        head: wps.PsHead,
        described: tuple[JobConfig, list[TensorMeta]] | None,
        credential: bytes,
    ) -> None:
        job, members, consistency = run.job, run.members, run.consistency
        job.check_worker(head)
        job.check_joining_job(described)  # a worker of another job changes nothing, not even by waiting
        with request.waiting():  # a restarted worker: its old process is dropped after its heartbeats
            await consistency.wait(lambda: members.rank_free(head), head, f"rank {head.worker} to be freed")
        async with self._replica.in_order():
            consistency.check_open()
            async with consistency.step_lock():  # a step being taken does not count it
                members.check_rank_free(head)
                job.check_joining_job(described)  # the job may have been created meanwhile
                job.check_owner(credential, "PS_JOIN")  # ... or claimed by another join meanwhile
                # Every check passed: this join claims an unclaimed job (its backups hear the owner
                # it will have; nothing is claimed if replicating it fails).
                owner = job.owner if job.owner is not None else token_digest(credential)
                await self._replica.replicate(replication.Change.JOIN, head, replication.encode_owner(owner))
                self._claim(run, credential)
                reply = self._admit(run, head)
            await consistency.apply_ready_steps()  # a rejoin for the next step may complete this one
        await request.reply(reply)

    @staticmethod
    def _admit(run: JobRun, head: wps.PsHead) -> bytes:
        reply = run.members.admit(head)
        run.consistency.notify()
        return reply

    async def on_leave(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        final = wps.decode_flag(request.meta, default=True)
        request.meta.done()
        run = self.jobs.get(head.job) if head.job else None
        state = run.members.workers.get(head.worker) if run is not None else None
        member = run is not None and run.members.session_of(head) is not None
        session = frame_session(request, head)
        # The job's worker of that rank, or the exchange client that holds it in the exchange (a
        # program may use both under one rank); anyone else changes nothing.
        held = self._exchange.held_by(head.worker, session)
        if run is not None and state is not None and state.live and head.seq and not member and not held:
            run.members.refuse_identity(request, head, head.seq)
        self._exchange.leave(head.worker, session, strict=not member)
        # A worker dropped for missed heartbeats that then leaves for good (its own session, still
        # the rank's last): its leave counts too, or its job could never end by itself.
        dropped_self = (
            state is not None and not state.live and bool(head.seq) and state.incarnation == head.seq
        )
        if member or (final and dropped_self):
            assert run is not None
            async with self._replica.in_order():
                await self._replica.replicate(replication.Change.LEAVE, head, wps.encode_flag(final))
                await run.consistency.leave(head.worker, "left" if final else "stepped aside", final=final)
                if final and self.jobs.done(run):  # its last worker: the job ends (its backups follow)
                    await self._replica.replicate(replication.Change.END, head, wps.encode_flag(False))
                    await self.jobs.end(run, LAST_WORKER_LEFT)
        await request.reply(b"")

    async def drop(self, run: JobRun, worker: int) -> None:
        """A worker the heartbeat watchdog found silent: out of the job, and out of the exchange
        where its own session holds the rank there (a rank of the exchange that another client
        holds is that client's, whatever a job's worker of the same number does)."""
        member = run.members.workers.get(worker)
        if member is not None:
            self._exchange.leave(worker, ("seq", member.incarnation), strict=False)
        run.members.dropped += 1
        async with self._replica.in_order():
            # Stepped down meanwhile: its primary decides. A backup refusing the credentials:
            # the drop is not made (the worker stays live); the next round tries again.
            with contextlib.suppress(NotPrimary, ReplicationRefused):
                await self._replica.replicate(replication.Change.DROP, wps.PsHead(worker, job=run.id))
                timeout = run.members.heartbeat_timeout
                await run.consistency.leave(worker, f"dropped (no heartbeat for {timeout:.3g}s)")

    async def on_heartbeat(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        run = self.jobs.get(head.job) if head.job else None
        state = run.members.session_of(head) if run is not None else None
        if state is not None:
            state.heard = time.monotonic()
        await request.reply(wps.encode_u32(int(state is not None)))

    # -- barriers, ends, rollbacks --------------------------------------------------------------
    async def on_barrier(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        run = self.run_of(head)
        released = await run.consistency.barrier(request, head)
        await request.reply(wps.encode_u64(released))

    async def on_end(self, request: Request) -> None:
        """PS_END (``tensorwire ps end JOB [--force]``): see the module doc for who may."""
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        force = wps.decode_flag(request.meta)
        credential = wps.decode_credential(request.meta)
        request.meta.done()
        run = self.jobs.get(head.job) if head.job else None
        if run is None:
            raise ProtocolError(f"this server holds no job {head.job!r}")
        self._check_may_end(run, credential)
        live = run.members.live()
        if live and not force:
            raise ProtocolError(
                f"job {run.id!r} has live workers ({', '.join(map(str, live[:16]))}): it ends when they "
                "leave, or now with --force (they then get an error)"
            )
        async with self._replica.in_order():
            await self._replica.replicate(replication.Change.END, head, wps.encode_flag(force))
            await self.jobs.end(run, _ended_by_operator(force), force=force)
        await request.reply(b"")

    def _check_may_end(self, run: JobRun, credential: bytes) -> None:
        """NotAuthorized unless ``credential`` is the job's token or the operator's (a job started
        without a token: anyone's)."""
        if run.job.owner in (None, OPEN) or run.job.owned_by(credential):
            return
        operator = self._operator
        if operator is not None and hmac.compare_digest(operator, token_digest(credential)):
            return
        raise run.job.refuse(credential, "PS_END", operator=operator is not None)

    async def on_rollback(self, request: Request) -> None:
        """Go back to the job's checkpoint of version ``clock``: after a restart of several
        servers, workers bring them all to the newest version every one of them has. Or, in sync
        mode, one step forward (``clock`` is the next step): the step this server missed while the
        others took it (every worker dropped here mid-step, say) is taken empty, as a step whose
        workers were all dropped, when the others keep no checkpoint to go back to."""
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        run = self.run_of(head)
        if live := run.members.live():
            # Another worker is live here: it is still moving the job (its push may be what a server
            # behind waits for), so the job is not stuck. The asker stepped aside: it rejoins and looks
            # again, as after any drop.
            raise WorkerDropped(f"not rolling job {run.id!r} back: workers {live[:16]} are live here; rejoin")
        _check_stepped_aside(request, run, head)
        job = run.job
        if _forward(run, head.clock):
            async with self._replica.in_order():
                await self._replica.replicate(replication.Change.ROLLBACK, head)
                await run.consistency.skip_step(head.clock - 1)
            await request.reply(wps.encode_u64(job.version))
            return
        policy = run.state.policy
        # The checkpoint is read beside the job it replaces: a second copy of the job, counted (as
        # ``restore``) while both are held.
        held = run.budget.held["params"] + run.budget.held["optimizer"]
        run.gradients.make_room(held)
        run.budget.reserve("restore", held, f"reading job {run.id!r}'s checkpoint beside the job")
        try:
            # Read first (off the loop): one that is not complete changes nothing, here or on a backup.
            snapshot = await run.job.run(checkpoint.load, policy.directory, head.clock) if policy else None
            if snapshot is None:
                raise WorkerDropped(
                    f"no checkpoint of version {head.clock} of job {run.id!r} here to roll back to"
                )
            async with self._replica.in_order():
                await self._replica.replicate(replication.Change.ROLLBACK, head)
                run.state.restored(snapshot)
                run.consistency.notify()
        finally:
            run.budget.release("restore", held)
        await request.reply(wps.encode_u64(run.job.version))

    # -- a backup -------------------------------------------------------------------------------
    async def make_change(self, change: replication.Change, head: wps.PsHead, request: Request) -> None:
        """A backup makes its primary's change (checked by ``Replica.on_replicate``) as it did."""
        if change == replication.Change.PING:
            return
        if change in (replication.Change.CREATE, replication.Change.JOIN):
            run = self.jobs.open(head.job, limit=False)  # the primary checked --max-jobs
            if change == replication.Change.CREATE:
                await self._make_create(run, head, request)
                return
            owner = replication.decode_owner(request.meta)
            if owner is not None:  # the primary's say (a job restored there may be claimed since)
                run.job.owner = owner
            async with run.consistency.step_lock():
                self._admit(run, head)
            await run.consistency.apply_ready_steps()
            return
        held = self.jobs.get(head.job)
        if held is None:  # the primary sends it a state transfer first, then this change again
            raise ProtocolError(f"job {head.job!r} is not on this backup: out of step with its primary")
        run = held
        if change == replication.Change.LEAVE:
            final = wps.decode_flag(request.meta, default=True)
            await run.consistency.leave(head.worker, "left" if final else "stepped aside", final=final)
        elif change == replication.Change.DROP:
            await run.consistency.leave(head.worker, "dropped (replicated)")
        elif change == replication.Change.PUSH:
            await run.consistency.apply_replicated(request, head)
        elif change == replication.Change.READ:
            run.members.workers[head.worker].read_clock = head.clock
        elif change == replication.Change.BARRIER:
            run.consistency.arrive(head.worker, head.clock)
        elif change == replication.Change.END:
            force = wps.decode_flag(request.meta)
            # The change says only whether it was forced. A job its last worker left ended so here
            # too: that worker's LEAVE came first, and this record must not blame an operator.
            why = LAST_WORKER_LEFT if not force and self.jobs.done(run) else _ended_by_operator(force)
            await self.jobs.end(run, why, force=force)
        elif change == replication.Change.ROLLBACK and _forward(run, head.clock):
            await run.consistency.skip_step(head.clock - 1)
        elif change == replication.Change.ROLLBACK and run.state.policy is not None:
            run.state.restore(run.state.policy.directory, head.clock)

    async def _make_create(self, run: JobRun, head: wps.PsHead, request: Request) -> None:
        config = JobConfig.from_json(wps.decode_config(request.meta))
        metas = wm.decode_records(request.meta)
        check_replicated(metas, request.header.data_len, run.budget.capacity)  # before allocating
        values = [torch.empty(m.numel, dtype=m.dtype) for m in metas]
        await request.receive([byte_view(v) for v in values])
        run.job.install(head.world, config, metas, values)


def _forward(run: JobRun, clock: int) -> bool:
    """Whether a PS_ROLLBACK to ``clock`` is the one step forward of a sync job (``on_rollback``)."""
    job = run.job
    return job.mode is not None and job.mode.kind == "sync" and clock == job.step + 1


def _check_stepped_aside(request: Request, run: JobRun, head: wps.PsHead) -> None:
    """Only a worker of the job that stepped aside to roll it back (its rank joined by the
    session sending it, not left for good) may move the job to an older checkpoint: anyone
    else could make a server drop acknowledged steps while no worker is live."""
    state = run.members.workers.get(head.worker)
    if state is None or state.finished:
        raise ProtocolError(
            f"a rollback of job {run.id!r} comes from one of its workers (worker {head.worker} "
            f"{'left it for good' if state is not None else 'never joined it'})"
        )
    if head.seq != state.incarnation:
        run.members.refuse_identity(request, head, head.seq)


def _ended_by_operator(force: bool) -> str:
    return "ended by tensorwire ps end" + (" --force" if force else "")
