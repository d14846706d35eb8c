"""The server side of the parameter server: ``ParamServer``, which wires the parts of it together.

A ``ParamServer`` is an extension of a tensorwire ``Server`` (``Server(extensions=[ParamServer()])``,
which ``tensorwire ps serve`` does). It serves several jobs at once, each named by the id every
parameter-server request carries (wire/ps.py). For each job it holds the shards that workers
placed on it (``PS_INIT``), each as an ``nn.Parameter`` over a flat range of elements, with one
``torch.optim`` optimizer over all of them, and applies pushed gradients under one of three modes
(``sync``, ``async``, ``ssp:<s>``). One concern per module, each a plain class that holds its state:

* jobs.py ``Jobs``, ``JobRun``: the jobs by id (at most ``max_jobs``), each with its own parts:
  * ../job.py ``Job``: the job's config, shards, optimizer, its thread and lock, its counters, and
    the checks that refuse a worker that names the job but runs another one (naming the differences);
  * membership.py ``Members``: one record per worker (clock, liveness, the session holding the
    rank, push marks, barrier, heartbeats), joining clocks, the heartbeat watchdog, identity refusal;
  * gradients.py ``Gradients``: the buffers pushes land in and the sync pushes waiting for a step;
  * consistency.py ``Consistency``: the modes' gates and waits, PS_PUSH (exactly once), the steps,
    barriers;
  * snapshots.py ``Snapshots``: PS_PULL and the copies of the parameters pulls send from;
  * state.py ``State``: the job taken or loaded as a whole (checkpoints, state transfers);
* lifecycle.py ``Lifecycle``: PS_INIT, PS_JOIN, PS_LEAVE, PS_BARRIER, PS_END, PS_ROLLBACK, drops,
  and the changes a backup makes;
* replica.py ``Replica``: the server's role and epoch, the order of changes, replication,
  failover, fencing, PS_REPLICATE (replication.py: its wire and the connections to the backups);
  one per server process, for all its jobs;
* ../budget.py ``Budget``: what the jobs hold, counted in the process's one capacity (the store's);
  ../exchange/server.py: ALLREDUCE and gRPC UpdateGradient, server-wide (below).

Here: the extension seam (``frame_handlers``, ``rpc_handlers``, ``collectors``, ``status``,
``close``), PS_PUSH, PS_PULL, PS_HEARTBEAT and PS_STATS handed to their job, and the attributes
code and tests have always read on a ``ParamServer`` (``step``, ``version``, ``workers``, ``role``,
...): the server's own, or those of its one job (``sole``).

The gradient exchange stays server-wide: its rounds are keyed by (step, tensor name) and its
ranks bound to sessions, it holds no parameters or optimizer state a job could leak to another,
and its gRPC callers (``train.GradientService``, a fixed schema) have no way to name a job.

Who may act as a rank: the session (worker process) that joined with it, named by its random
incarnation, which every push, pull, heartbeat and leave of the rank carries (membership.py).
Every wait is bounded by the request's ``wait_ms`` or the server's ``wait_timeout`` and ends in a
TIMEOUT error that names what was waited for and who (consistency.py). All state is changed on the
event loop; optimizer steps and gradient sums run in each job's worker thread (torch releases the
GIL), so the loop keeps receiving the next push meanwhile. Pulls read the parameters under a
shared lock that a step takes exclusively, so a pull never sees half a step.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, cast, overload

import torch

from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.errors import ProtocolError
from tensorwire.ps.budget import Budget
from tensorwire.ps.exchange import rpc as exchange_rpc
from tensorwire.ps.exchange.server import GradientExchange
from tensorwire.ps.job import CheckpointPolicy, HeldShard, Job, JobConfig, Mode
from tensorwire.ps.server import metrics, replication
from tensorwire.ps.server.jobs import DEFAULT_MAX_JOBS, JobRun, Jobs, JobSettings
from tensorwire.ps.server.leadership import Coordination
from tensorwire.ps.server.lifecycle import Lifecycle
from tensorwire.ps.server.membership import Member, Members
from tensorwire.ps.server.relay import RelayPublisher
from tensorwire.ps.server.replica import Replica
from tensorwire.ps.server.state import State
from tensorwire.security import Security
from tensorwire.server.core import Handler, Request, Server
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

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
    """The jobs of one server: shards of their parameters, with their optimizers (see the module doc).

    ``capacity``: the most bytes all jobs together may hold here, their parameters and what pushes
    and pulls keep (budget.py); once added to a server they (and the gradient exchange) also count
    in its store's capacity, the process's one ledger (``tensorwire serve --capacity``). ``max_jobs``: the
    most jobs held at once (job ids are chosen by peers); ``keep_jobs``: a job whose last worker
    left keeps its state (for a restart of its workers) instead of ending (ps/server/jobs.py).
    ``operator_token``: the servers' operator token (``ps serve --operator-token-file``), which may end
    any job; a job's own token (ps/job.py) always may. ``coordinator``: the slot's primary is decided
    by a lease in a coordinator (etcd; ps/server/leadership.py), not by the replicas themselves.
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
        max_jobs: int = DEFAULT_MAX_JOBS,
        keep_jobs: bool = False,
        operator_token: str | None = None,
        coordinator: Coordination | None = None,
    ) -> None:
        self.capacity = capacity
        self.wait_timeout = wait_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.checkpoints = checkpoints
        self.budget = Budget(capacity)
        # The gradient exchange (ALLREDUCE, gRPC GradientService) rides on the same server.
        self.exchange = GradientExchange(workers, wait_timeout, capacity)
        leadership = coordinator.leadership(standby=standby) if coordinator is not None else None
        self._replica = replica = Replica(
            backups, peer, standby=standby, failover_timeout=failover_timeout, leadership=leadership
        )
        settings = JobSettings(wait_timeout, heartbeat_timeout, checkpoints)
        self.jobs = Jobs(
            lambda job_id: JobRun(job_id, self.budget, replica, settings, self._lifecycle.drop),
            max_jobs=max_jobs,
            keep_jobs=keep_jobs,
        )
        replica.hold(self.jobs)
        self._lifecycle = Lifecycle(self.jobs, replica, self.exchange, operator=operator_token)
        self.operator = operator_token is not None
        self._blank: JobRun | None = None
        self.relay = RelayPublisher()  # versions published for relay pulls (PS_RELAY)

    def added_to(self, server: Server) -> None:
        """Joined ``server`` (``Server.extend``): its jobs and the gradient exchange count in the
        process's one capacity, the store's (``--capacity``: budget.py); relay pulls publish into
        its generations, and it serves the relay (its ``RelayCoordinator``, the one it has or a new
        one)."""
        self.budget.attach(server.store)
        self.exchange.attach(server.store)
        # A server that admits only some clients: a job they start without a token is said (ps/job.py).
        security = server.security
        self._lifecycle.say_open = security.token is not None or (security.tls is not None and
                                                                  security.tls.ca is not None)  # fmt: skip
        self.relay.attach(server.generations, RelayCoordinator.of(server).chains)

    async def started(self, server: Server) -> None:
        """The server listens: with a coordinator, this replica watches and campaigns for its
        slot's lease from now on (ps/server/leadership.py). First, off the loop, it builds an
        optimizer once: the first one imports much of torch (1-2 s), which on the loop, at a job's
        first PS_INIT, would stall the renewals past a short term."""
        if self._replica.leadership is not None and server.addresses:
            await asyncio.to_thread(_warm_optimizers)
            self._replica.lead(str(server.addresses[0]), server.store_id)

    # The server's own attributes, and its one job's (``sole``), under the names a ParamServer
    # always had.
    config = _Of[JobConfig | None]("_job")
    shards = _Of[dict[str, HeldShard]]("_job")
    optimizer = _Of[torch.optim.Optimizer | None]("_job")
    world = _Of[int]("_job")
    step = _Of[int]("_job")  # sync: steps taken; the clock the next step is for
    version = _Of[int]("_job")  # updates applied, in any mode
    pushes = _Of[int]("_job")
    jobs_refused = _Of[int]("_job")
    workers = _Of[dict[int, Member]]("_members")
    identity_refused = _Of[int]("_members")
    dropped = _Of[int]("_members")  # workers dropped for missed heartbeats
    duplicates = _Of[int]("_consistency")  # resent pushes answered without being applied again
    staleness = _Of[Counter[int]]("_consistency")
    restored_from = _Of[str | None]("_state")
    checkpoints_skipped = _Of[int]("_state", "skipped")
    role = _Of[str]("_replica")  # primary, backup or fenced
    epoch = _Of[int]("_replica")
    failovers = _Of[int]("_replica")
    failover_timeout = _Of[float]("_replica")
    peer = _Of[Security]("_replica")
    replicate_refused = _Of[Counter[str]]("_replica")

    def leadership_status(self) -> dict[str, Any] | None:
        """The slot's leadership as this replica sees it (with a coordinator; else None)."""
        leadership = self._replica.leadership
        return leadership.status() if leadership is not None else None

    def job(self, job_id: str) -> JobRun | None:
        """The job ``job_id`` held here, with its parts (``.job``, ``.members``, ...), if any."""
        return self.jobs.get(job_id)

    @property
    def sole(self) -> JobRun:
        """The server's one job, the only one it holds, else (none held) the one that ended last
        (its counters; its tensors are freed), else an empty one. LookupError with several."""
        runs = list(self.jobs)
        if len(runs) == 1:
            return runs[0]
        if runs:
            raise LookupError(
                f"this server holds {len(runs)} jobs ({', '.join(r.id for r in runs[:8])}): "
                "ask one of them, ParamServer.job(id)"
            )
        if self.jobs.last is not None:
            return self.jobs.last
        if self._blank is None:  # never opened: it holds nothing and counts nowhere
            self._blank = JobRun(
                "", Budget(self.capacity), self._replica, JobSettings(), self._lifecycle.drop
            )
        return self._blank

    @property
    def _job(self) -> Job:
        return self.sole.job

    @property
    def _members(self) -> Members:
        return self.sole.members

    @property
    def _consistency(self) -> Any:
        return self.sole.consistency

    @property
    def _state(self) -> State:
        return self.sole.state

    # -- the extension seam ---------------------------------------------------------------------
    def frame_handlers(self) -> Mapping[int, Handler]:
        life = self._lifecycle
        return {
            Opcode.PS_INIT: life.on_init,
            Opcode.PS_JOIN: life.on_join,
            Opcode.PS_LEAVE: life.on_leave,
            Opcode.PS_PUSH: self._on_push,
            Opcode.PS_PULL: self._on_pull,
            Opcode.PS_STATS: self._on_stats,
            Opcode.ALLREDUCE: self.exchange.on_allreduce,
            Opcode.PS_HEARTBEAT: life.on_heartbeat,
            Opcode.PS_ROLLBACK: life.on_rollback,
            Opcode.PS_REPLICATE: self._on_replicate,
            Opcode.PS_BARRIER: life.on_barrier,
            Opcode.PS_END: life.on_end,
            Opcode.PS_RELAY: self._on_relay,
        }

    def rpc_handlers(self) -> Sequence[Any]:
        return (exchange_rpc.rpc_handler(self.exchange),)

    def collectors(self) -> list[Any]:
        """Its Prometheus families (ps/server/metrics.py), for the server's registry."""
        return [metrics.PsCollector(self)]

    def status(self) -> dict[str, Any]:
        """Its part of the server's STATUS answer (``tensorwire status``)."""
        doc = {**self.stats(), **metrics.replication_status(self)}
        if len(self.jobs) == 1:
            doc["shard_keys"] = list(self.sole.job.shards)[:64]  # a sample: the count is in "shards"
        return {"ps": doc}

    @property
    def backups(self) -> replication.Backups | None:
        return self._replica.backups

    @property
    def peer_token(self) -> str | None:
        """The slot's peer token; the server opens a peer session for a HELLO that offers it."""
        return self.peer.token

    @property
    def primary_seen(self) -> float | None:
        """When (monotonic) a backup last heard from its primary."""
        return self._replica.primary_seen

    def job_samples(self) -> list[metrics.JobSample]:
        """What each job's metric families read (ps/server/metrics.py)."""
        return [metrics.JobSample.of(run) for run in self.jobs]

    async def close(self) -> None:
        """The server is stopping (SIGTERM): stop pinging, write each job's last checkpoint."""
        await self._replica.close()
        await self.jobs.close()

    # -- state queries --------------------------------------------------------------------------
    @property
    def mode(self) -> Mode | None:
        return self._job.mode

    def live(self) -> list[int]:
        return self._members.live()

    def slowest(self) -> int:
        """The slowest live worker's clock; 0 while some of the ``world`` have not joined yet."""
        return self._members.slowest()

    def stats(self, job: str | None = None) -> dict[str, Any]:
        """What ``PS_STATS`` answers (``tensorwire ps stats``): the server (its role, capacity, jobs,
        ended jobs), and ``job``'s view (else its one job's, as before jobs, if it holds one)."""
        jobs = self.jobs
        server = {
            "role": self.role,
            "epoch": self.epoch,
            "failovers": self.failovers,
            "capacity": self.capacity,
            "held_bytes": dict(self.budget.held),
            "capacity_refused": self.budget.refused,
            "max_jobs": jobs.max_jobs,
            "keep_jobs": jobs.keep_jobs,
            "jobs_limit_refused": jobs.refused,
            "operator": self.operator,  # whether an operator token may end any job
            "coordinator": self.leadership_status(),
            "relay": self.relay.stats(),
            "jobs": {run.id: run.summary() for run in jobs},
            "ended": [
                {k: r.get(k) for k in ("job", "ended", "mode", "world", "step", "version")}
                for r in jobs.ended
            ],
        }
        return {**self._job_doc(job), **server}

    def _job_doc(self, job: str | None) -> dict[str, Any]:
        """``job``'s view; without one, the one job's (none held: the last ended one's record, or
        an empty job's), and nothing when there are several."""
        if job:
            run = self.jobs.get(job)
            if run is not None:
                return run.stats()
            ended = [r for r in self.jobs.ended if r["job"] == job]
            if not ended:
                raise ProtocolError(f"this server holds no job {job!r}")
            return dict(ended[-1])
        if len(self.jobs) > 1:
            return {}
        if not len(self.jobs) and self.jobs.ended:
            return dict(self.jobs.ended[-1])
        return self.sole.stats()

    def restore(self, directory: Path, version: int | None = None) -> bool:
        """Load every job's newest complete checkpoint under ``directory`` (its ``<job id>``
        subdirectories; of ``version``, if given), if there is one; newer ones that are not
        complete (torn by a crash) are skipped, and that is said in the log and in
        ``stats()["checkpoint"]``. Its workers come back as not live: each rejoins (``ps.Worker``
        does it by itself). Whether any job was restored."""
        if version is not None:
            return any(run.state.restore(directory / run.id, version) for run in self.jobs)
        return bool(self.jobs.restore_all(directory))

    # -- the requests handed to a job ------------------------------------------------------------
    async def _on_push(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        await self._lifecycle.run_of(head).consistency.on_push(request, head)

    async def _on_pull(self, request: Request) -> None:
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        await self._lifecycle.run_of(head).pulls.on_pull(request, head)

    async def _on_relay(self, request: Request) -> None:
        """PS_RELAY: a pull's gate, then the version published for the relay (ps/server/relay.py)."""
        self._replica.serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        run = self._lifecycle.run_of(head)
        await run.pulls.admit(request, head)
        if head.worker != wps.OBSERVER:  # a live worker (admit checked its session) relays its job
            self.relay.admit(run.job.id, head.seq)
        with request.waiting():
            version, number = await self.relay.publish(run.job, lambda job: self.jobs.get(job) is not None)
        await request.reply(wps.encode_relay_reply(version, number))

    async def _on_stats(self, request: Request) -> None:
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        await request.reply(wps.encode_stats(json.dumps(self.stats(head.job or None), sort_keys=True)))

    async def _on_replicate(self, request: Request) -> None:
        await self._replica.on_replicate(request, self._lifecycle.make_change)


def _warm_optimizers() -> None:
    """Build and step an optimizer once, so that what torch imports then is imported now."""
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    for kind in (torch.optim.SGD, torch.optim.Adam):
        kind([param], lr=0.0).step()
