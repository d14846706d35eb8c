"""The server side of the parameter server: ``ParamServer``, which wires the parts of it together.

A ``ParamServer`` is an extension of a tensorwire ``Server`` (``Server(extensions=[ParamServer()])``,
which ``tensorwire ps serve`` does). It holds the shards that workers placed on it (``PS_INIT``),
each as an ``nn.Parameter`` over a flat range of elements, with one ``torch.optim`` optimizer over
all of them, and applies pushed gradients under one of three modes (``sync``, ``async``,
``ssp:<s>``). One concern per module, each a plain class that holds its state:

* job.py ``Job``: the job's config, shards, optimizer, its thread and lock, its counters, and the
  checks that refuse a worker of another job (one job per server, naming the differences);
* membership.py ``Members``: one record per worker (clock, liveness, the session holding the
  rank, push marks, heartbeats), joining clocks, the heartbeat watchdog, identity refusal;
* gradients.py ``Gradients``: the buffers pushes land in and the sync pushes waiting for a step;
* consistency.py ``Consistency``: the modes' gates and waits, PS_PUSH (exactly once), the steps;
* snapshots.py ``Snapshots``: PS_PULL and the copies of the parameters pulls send from;
* replica.py ``Replica``: role and epoch, the order of changes, replication, failover, fencing,
  PS_REPLICATE (replication.py: its wire and the primary's connections to its backups);
* state.py ``State``: the job taken or loaded as a whole (checkpoints, state transfers);
* budget.py ``Budget``: what the job holds against ``capacity``; exchange_server.py: ALLREDUCE.

Here: the extension seam (``frame_handlers``, ``rpc_handlers``, ``collectors``, ``status``,
``close``), the requests that cross the parts (PS_INIT, PS_JOIN, PS_LEAVE, PS_HEARTBEAT,
PS_ROLLBACK, PS_STATS, and the changes a backup makes), and the attributes code and tests have
always read on a ``ParamServer`` (``step``, ``version``, ``workers``, ``role``, ...), which are
the parts' own.

Who may act as a rank: the session (worker process) that joined with it, named by its random
incarnation, which every push, pull, heartbeat and leave of the rank carries (membership.py).
Every wait is bounded by the request's ``wait_ms`` or the server's ``wait_timeout`` and ends in a
TIMEOUT error that names what was waited for and who (consistency.py). All state is changed on the
event loop; optimizer steps and gradient sums run in one worker thread (torch releases the GIL),
so the loop keeps receiving the next push meanwhile. Pulls read the parameters under a shared
lock that a step takes exclusively, so a pull never sees half a step.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, cast, overload

import torch

from tensorwire.errors import NotPrimary, ProtocolError, ReplicationRefused, WorkerDropped
from tensorwire.ps import checkpoint, metrics, replication
from tensorwire.ps.budget import Budget
from tensorwire.ps.consistency import Consistency
from tensorwire.ps.exchange_server import GradientExchange, frame_session
from tensorwire.ps.gradients import Gradients
from tensorwire.ps.job import (
    CheckpointPolicy,
    HeldShard,
    Job,
    JobConfig,
    Mode,
    check_records,
    check_replicated,
    described_job,
)
from tensorwire.ps.membership import Member, Members
from tensorwire.ps.replica import Replica
from tensorwire.ps.snapshots import Snapshots
from tensorwire.ps.state import State
from tensorwire.security import Security
from tensorwire.server.core import Handler, Request
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view

__all__ = ["CheckpointPolicy", "JobConfig", "Mode", "ParamServer"]

T = TypeVar("T")


class _Of(Generic[T]):
    """An attribute of one of a ``ParamServer``'s parts (named by the attribute holding it), read
    and set on the ``ParamServer`` under the same name, as it always was."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self._part = part
        self._name = name or ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = self._name or name

    @overload
    def __get__(self, obj: None, owner: type) -> _Of[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> T | _Of[T]:
        if obj is None:
            return self
        return cast(T, getattr(getattr(obj, self._part), self._name))

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self._part), self._name, value)


class ParamServer:
    """One server's shards of a job's parameters, with their optimizer (see the module doc).

    ``capacity``: the most bytes the job may hold here, its parameters and what pushes and pulls
    keep (budget.py); ``tensorwire serve`` passes its ``--capacity``.
    """

    def __init__(
        self,
        wait_timeout: float = 120.0,
        workers: int = 1,
        capacity: int = 1 << 62,
        *,
        heartbeat_timeout: float = 0.0,
        checkpoints: CheckpointPolicy | None = None,
        backups: Sequence[str] = (),
        standby: bool = False,
        failover_timeout: float = 2.0,
        peer: Security | None = None,
    ) -> None:
        self.capacity = capacity
        self.budget = Budget(capacity)
        # The gradient exchange (ALLREDUCE, gRPC GradientService) rides on the same server.
        self.exchange = GradientExchange(workers, wait_timeout, capacity)
        self._job = job = Job(self.budget)
        self._gradients = gradients = Gradients(job, self.budget)
        self._members = members = Members(
            job, gradients, heartbeat_timeout, primary=lambda: self.role == "primary", drop=self._drop
        )
        self._state = state = State(checkpoints, job, members, gradients)
        self._replica = replica = Replica(
            backups,
            peer,
            standby=standby,
            failover_timeout=failover_timeout,
            job=job,
            members=members,
            state=state,
        )
        self._consistency = Consistency(
            job, members, gradients, state=state, replica=replica, wait_timeout=wait_timeout
        )
        self._pulls = Snapshots(
            job, self.budget, gradients, members=members, consistency=self._consistency, replica=replica
        )
        self._initializing = False

    # The parts' attributes, under the names a ParamServer always had.
    config = _Of[JobConfig | None]("_job")
    shards = _Of[dict[str, HeldShard]]("_job")
    optimizer = _Of[torch.optim.Optimizer | None]("_job")
    world = _Of[int]("_job")
    step = _Of[int]("_job")  # sync: steps taken; the clock the next step is for
    version = _Of[int]("_job")  # updates applied, in any mode
    pushes = _Of[int]("_job")
    jobs_refused = _Of[int]("_job")
    workers = _Of[dict[int, Member]]("_members")
    heartbeat_timeout = _Of[float]("_members")
    identity_refused = _Of[int]("_members")
    dropped = _Of[int]("_members")  # workers dropped for missed heartbeats
    wait_timeout = _Of[float]("_consistency")
    duplicates = _Of[int]("_consistency")  # resent pushes answered without being applied again
    staleness = _Of[Counter[int]]("_consistency")
    role = _Of[str]("_replica")  # primary, backup or fenced
    epoch = _Of[int]("_replica")
    failovers = _Of[int]("_replica")
    failover_timeout = _Of[float]("_replica")
    peer = _Of[Security]("_replica")
    replicate_refused = _Of[Counter[str]]("_replica")
    checkpoints = _Of[CheckpointPolicy | None]("_state", "policy")
    restored_from = _Of[str | None]("_state")
    checkpoints_skipped = _Of[int]("_state", "skipped")

    # -- the extension seam ---------------------------------------------------------------------
    def frame_handlers(self) -> Mapping[int, Handler]:
        return {
            Opcode.PS_INIT: self._on_init,
            Opcode.PS_JOIN: self._on_join,
            Opcode.PS_LEAVE: self._on_leave,
            Opcode.PS_PUSH: self._consistency.on_push,
            Opcode.PS_PULL: self._pulls.on_pull,
            Opcode.PS_STATS: self._on_stats,
            Opcode.ALLREDUCE: self.exchange.on_allreduce,
            Opcode.PS_HEARTBEAT: self._on_heartbeat,
            Opcode.PS_ROLLBACK: self._on_rollback,
            Opcode.PS_REPLICATE: self._on_replicate,
        }

    def rpc_handlers(self) -> Sequence[Any]:
        return (self.exchange.rpc_handler(),)

    def collectors(self) -> list[Any]:
        """Its Prometheus families (ps/metrics.py), for the server's registry."""
        return [metrics.PsCollector(self)]

    def status(self) -> dict[str, Any]:
        """Its part of the server's STATUS answer (``tensorwire status``)."""
        doc = {**self.stats(), "live": self.live(), **metrics.replication_status(self)}
        doc["shard_keys"] = list(self.shards)[:64]  # a sample: the count is in "shards"
        return {"ps": doc}

    @property
    def backups(self) -> replication.Backups | None:
        return self._replica.backups

    @property
    def peer_token(self) -> str | None:
        """The slot's peer token: the server opens a peer session for a HELLO that offers it."""
        return self.peer.token

    @property
    def primary_seen(self) -> float | None:
        """When (monotonic) a backup last heard from its primary."""
        return self._replica.primary_seen

    async def close(self) -> None:
        """The server is stopping (SIGTERM): stop watching heartbeats, write a last checkpoint."""
        await self._members.stop()
        await self._replica.close()
        if self.checkpoints is not None and self.config is not None:
            await self._state.write_checkpoint()
        self._job.shutdown()

    # -- state queries --------------------------------------------------------------------------
    @property
    def mode(self) -> Mode | None:
        return self._job.mode

    def live(self) -> list[int]:
        return self._members.live()

    def slowest(self) -> int:
        """The slowest live worker's clock; 0 while some of the ``world`` have not joined yet."""
        return self._members.slowest()

    def stats(self) -> dict[str, Any]:
        """What ``PS_STATS`` answers (and ``tensorwire ps stats`` prints)."""
        return {
            "mode": str(self.mode) if self.mode else None,
            "optimizer": self.config.optimizer.to_dict() if self.config else None,
            "world": self.world,
            "step": self.step,
            "version": self.version,
            "pushes_applied": self.pushes,
            "shards": len(self.shards),
            "bytes": sum(s.meta.nbytes for s in self.shards.values()),
            "workers": {
                str(w): {"clock": s.clock, "live": s.live, "seq": s.seq}
                for w, s in sorted(self.workers.items())
            },
            "duplicates_ignored": self.duplicates,
            "role": self.role,
            "epoch": self.epoch,
            "failovers": self.failovers,
            "pulls_sending": self._pulls.sending,
            "workers_dropped": self.dropped,
            "identity_refused": self.identity_refused,
            "jobs_refused": self.jobs_refused,
            "capacity": self.capacity,
            "held_bytes": dict(self.budget.held),
            "capacity_refused": self.budget.refused,
            "checkpoint": {"restored": self.restored_from, "skipped": self.checkpoints_skipped},
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "max_staleness": max(self.staleness, default=0),
        }

    def restore(self, directory: Path, version: int | None = None) -> bool:
        """Load the newest complete checkpoint (of ``version``, if given) of ``directory``, if there
        is one; newer ones that are not complete (torn by a crash) are skipped, and that is said in
        the log and in ``stats()["checkpoint"]``. Its workers come back as not live: each rejoins
        (``ps.Worker`` does it by itself)."""
        return self._state.restore(directory, version)

    # -- joining and leaving --------------------------------------------------------------------
    async def _on_init(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        config = JobConfig.from_json(wps.decode_config(request.meta))
        metas = wm.decode_records(request.meta)
        request.meta.done()
        # Without data it only checks that the server's job is the worker's (a rejoining worker).
        check_only = request.header.data_len == 0 and any(m.nbytes for m in metas)
        check_records(metas, None if check_only else request.header.data_len)
        if check_only and self.config is None and not self._initializing:
            raise ProtocolError("PS_INIT without values, but this server has no job yet")
        self._job.check_worker(head)
        if self.config is None and not self._initializing:
            copies = 1 + config.optimizer.state_copies
            self.budget.check(copies * request.header.data_len, "the job's parameters and optimizer state")
        if self.config is None and not self._initializing:
            await self._create(request, head, config, metas)
            await request.reply(wps.encode_init_reply(True, self.step))
            return
        await request.skip()  # someone else's values won: this worker pulls them
        with request.waiting():
            ready = lambda: self.config is not None or not self._initializing  # noqa: E731
            await self._consistency.wait(ready, head, "the job's parameters to be initialised")
        if self.config is None:  # the worker creating it failed: this one may try again
            raise WorkerDropped("the worker that was creating the job failed: initialise it again")
        self._job.check_same_job(config, metas)
        await request.reply(wps.encode_init_reply(False, self.step))

    async def _create(
        self, request: Request, head: wps.PsHead, config: JobConfig, metas: list[TensorMeta]
    ) -> None:
        self._initializing = True
        try:
            values = [torch.empty(m.numel, dtype=m.dtype) for m in metas]
            await request.receive([byte_view(v) for v in values])
            async with self._replica.in_order():
                body = wps.encode_config(config.to_json()) + wm.encode_records(metas)
                await self._replica.replicate(
                    replication.Change.CREATE, head, body, [byte_view(v) for v in values]
                )
                self._job.install(head.world, config, metas, values)
        finally:
            self._initializing = False
            self._consistency.notify()

    async def _on_join(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        job = described_job(request.meta)
        request.meta.done()
        self._job.check_worker(head)
        if not head.seq:
            raise ProtocolError("PS_JOIN needs the worker process's incarnation (random, not 0) in seq")
        self._job.check_joining_job(job)  # a worker of another job changes nothing, not even by waiting
        with request.waiting():  # a restarted worker: its old process is dropped after its heartbeats
            await self._consistency.wait(
                lambda: self._members.rank_free(head), head, f"rank {head.worker} to be freed"
            )
        async with self._replica.in_order():
            async with self._consistency.step_lock():  # a step being taken does not count it
                self._members.check_rank_free(head)
                self._job.check_joining_job(job)  # the job may have been created meanwhile
                await self._replica.replicate(replication.Change.JOIN, head)
                reply = self._admit(head)
            await self._consistency.apply_ready_steps()  # a rejoin for the next step may complete this one
        await request.reply(reply)

    def _admit(self, head: wps.PsHead) -> bytes:
        reply = self._members.admit(head)
        self._consistency.notify()
        return reply

    async def _on_leave(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        state = self.workers.get(head.worker)
        member = self._members.session_of(head) is not None
        session = frame_session(request, head)
        # The job's worker of that rank, or the exchange client that holds it in the exchange (a
        # program may use both under one rank); anyone else changes nothing.
        held = self.exchange.held_by(head.worker, session)
        if state is not None and state.live and head.seq and not member and not held:
            self._members.refuse_identity(request, head, head.seq)
        self.exchange.leave(head.worker, session, strict=not member)
        if member:
            async with self._replica.in_order():
                await self._replica.replicate(replication.Change.LEAVE, head)
                await self._consistency.leave(head.worker, "left")
        await request.reply(b"")

    async def _drop(self, worker: int) -> None:
        """A worker the heartbeat watchdog found silent: out of the exchange and the job."""
        self.exchange.leave(worker)
        self._members.dropped += 1
        async with self._replica.in_order():
            # Stepped down meanwhile: its primary decides. A backup refusing the credentials:
            # the drop is not made (the worker stays live); the next round tries again.
            with contextlib.suppress(NotPrimary, ReplicationRefused):
                await self._replica.replicate(replication.Change.DROP, wps.PsHead(worker))
                await self._consistency.leave(
                    worker, f"dropped (no heartbeat for {self._members.heartbeat_timeout:.3g}s)"
                )

    async def _on_heartbeat(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        state = self._members.session_of(head)
        if state is not None:
            state.heard = time.monotonic()
        await request.reply(wps.encode_u32(int(state is not None)))

    # -- rollback, stats, and the changes a backup makes ---------------------------------------
    async def _on_rollback(self, request: Request) -> None:
        """Go back to the checkpoint of version ``clock``: after a restart of several servers,
        workers bring them all to the newest version every one of them has."""
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        if self.live():
            raise ProtocolError(f"cannot roll back while workers {self.live()} are live")
        directory = self.checkpoints.directory if self.checkpoints is not None else None
        # Read first (off the loop): a checkpoint that is not complete changes nothing, here or on a backup.
        snapshot = await self._job.run(checkpoint.load, directory, head.clock) if directory else None
        if snapshot is None:
            raise WorkerDropped(f"no checkpoint of version {head.clock} here to roll back to")
        async with self._replica.in_order():
            await self._replica.replicate(replication.Change.ROLLBACK, head)
            self._state.restored(snapshot)
        await request.reply(wps.encode_u64(self.version))

    async def _on_stats(self, request: Request) -> None:
        wps.PsHead.decode(request.meta)
        request.meta.done()
        await request.reply(wps.encode_stats(json.dumps(self.stats(), sort_keys=True)))

    async def _on_replicate(self, request: Request) -> None:
        await self._replica.on_replicate(request, self._make_change)

    async def _make_change(self, change: replication.Change, head: wps.PsHead, request: Request) -> None:
        """A backup makes its primary's change (checked by ``Replica.on_replicate``) as it did."""
        if change == replication.Change.CREATE:
            config = JobConfig.from_json(wps.decode_config(request.meta))
            metas = wm.decode_records(request.meta)
            check_replicated(metas, request.header.data_len, self.capacity)  # before allocating
            values = [torch.empty(m.numel, dtype=m.dtype) for m in metas]
            await request.receive([byte_view(v) for v in values])
            self._job.install(head.world, config, metas, values)
        elif change == replication.Change.JOIN:
            async with self._consistency.step_lock():
                self._admit(head)
            await self._consistency.apply_ready_steps()
        elif change in (replication.Change.LEAVE, replication.Change.DROP):
            await self._consistency.leave(head.worker, "left (replicated)")
        elif change == replication.Change.PUSH:
            await self._consistency.apply_replicated(request, head)
        elif change == replication.Change.READ:
            self.workers[head.worker].read_clock = head.clock
        elif change == replication.Change.ROLLBACK and self.checkpoints is not None:
            self.restore(self.checkpoints.directory, head.clock)
