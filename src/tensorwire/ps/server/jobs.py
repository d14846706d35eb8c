"""The jobs of one parameter server: each with parts of its own, and the registry that opens and
ends them.

* ``JobRun``: one job's parts, wired: its ``Job`` (config, shards, optimizer, thread), gradient
  buffers, members (ranks, sessions, heartbeats, barriers), state (checkpoints), consistency
  (clocks, pending steps) and pull snapshots; its own ``Budget`` (part of the server's one
  capacity) and checkpoint directory (``<--checkpoint-dir>/<job id>``).
* ``Jobs``: the server's jobs by id. Ids are chosen by peers: ``open`` makes a job for a new one
  only while fewer than ``max_jobs`` are held (else LimitExceeded naming ``--max-jobs``, counted in
  ``refused``), and a job a request opened but left empty (no parameters, no worker: a refused
  join) is dropped again (``prune``). ``end`` ends one; ``take_all`` and ``load_all`` are the state
  transfer of every job (ps/server/replica.py ``Holder``); ``restore_all`` loads every job's checkpoints.

When a job ends: by default when its last worker leaves (PS_LEAVE with ``final``, sent by
``Worker.close``, once every rank of its world has joined and left so), unless the server keeps
jobs (``--keep-jobs``: the state stays for a restart of the workers); or by PS_END (``tensorwire ps
end JOB``; refused while workers are live unless forced: those workers then get an error naming the
end, not a fresh job). A worker dropped for missed heartbeats has not left: the job waits for it
(it may come back, or leave), even once the others have left. Ending writes the job's last
checkpoint (checkpoints on) and moves its directory to ``_ended/`` (ps/server/checkpoint.py ``retire``),
wakes its waiters with an error, frees its memory and stops its thread. A record of it (its last
stats and why it ended) stays in ``ended``, at most ``max_jobs`` of them.

Lifecycle: ``Jobs`` is made with the server; ``close`` at the server's close writes every job's
last checkpoint and stops their heartbeat watchdogs and threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tensorwire.errors import LimitExceeded, PersistenceError, ProtocolError
from tensorwire.logs import event
from tensorwire.ps.budget import Budget
from tensorwire.ps.job import CheckpointPolicy, Job, JobConfig, default_job_id
from tensorwire.ps.server import checkpoint
from tensorwire.ps.server.consistency import Consistency
from tensorwire.ps.server.gradients import Gradients
from tensorwire.ps.server.membership import Members
from tensorwire.ps.server.replica import Replica
from tensorwire.ps.server.snapshots import Snapshots
from tensorwire.ps.server.state import State
from tensorwire.wire import ps as wps

log = logging.getLogger("tensorwire.ps")
DEFAULT_MAX_JOBS = 8
MAX_RECORDED_WORKERS = 256  # an ended job's record keeps the clocks of at most this many workers


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What every job of one server gets: its waits, heartbeats and checkpoints."""

    wait_timeout: float = 120.0
    heartbeat_timeout: float = 0.0
    checkpoints: CheckpointPolicy | None = None  # the server's: each job writes under its own directory


class JobRun:
    """One job's parts on this server (see the module doc)."""

    def __init__(
        self,
        job_id: str,
        server_budget: Budget,
        replica: Replica,
        settings: JobSettings,
        drop: Callable[[JobRun, int], Awaitable[None]],
    ) -> None:
        self.id = job_id
        self.budget = Budget(server_budget.capacity, part_of=server_budget)
        self.job = Job(self.budget, job_id)
        self.gradients = Gradients(self.job, self.budget)
        self.members = Members(
            self.job,
            self.gradients,
            settings.heartbeat_timeout,
            primary=lambda: replica.role == "primary",
            drop=lambda worker: drop(self, worker),
        )
        policy = settings.checkpoints
        if policy is not None:
            policy = dataclasses.replace(policy, directory=policy.directory / job_id)
        self.state = State(policy, self.job, self.members, self.gradients)
        self.consistency = Consistency(
            self.job,
            self.members,
            self.gradients,
            state=self.state,
            replica=replica,
            wait_timeout=settings.wait_timeout,
        )
        self.pulls = Snapshots(
            self.job,
            self.budget,
            self.gradients,
            members=self.members,
            consistency=self.consistency,
            replica=replica,
        )
        self.initializing = False  # a worker's PS_INIT is receiving the values

    @property
    def empty(self) -> bool:
        """No parameters, no worker, nobody making them: nothing to keep."""
        return self.job.config is None and not self.members.workers and not self.initializing

    def summary(self) -> dict[str, Any]:
        """One line of ``tensorwire ps stats`` / ``status``: id, mode, world, live workers, step."""
        job = self.job
        return {
            "mode": str(job.mode) if job.mode else None,
            "model": job.config.model if job.config else None,  # digest of names, shapes, dtypes
            "optimizer": job.config.optimizer.to_dict() if job.config else None,  # the dashboard shows it
            "pushes_applied": job.pushes,
            "world": job.world,
            "live": len(self.members.live()),
            "step": job.step,
            "version": job.version,
            "owner": _owner_said(job.owner),
        }

    def stats(self) -> dict[str, Any]:
        """The job's part of PS_STATS (what ``tensorwire ps stats --job`` prints)."""
        job, members, consistency = self.job, self.members, self.consistency
        return {
            "job": self.id,
            "mode": str(job.mode) if job.mode else None,
            "optimizer": job.config.optimizer.to_dict() if job.config else None,
            "world": job.world,
            "step": job.step,
            "version": job.version,
            "pushes_applied": job.pushes,
            "shards": len(job.shards),
            "bytes": sum(s.meta.nbytes for s in job.shards.values()),
            "workers": {
                str(w): {"clock": s.clock, "live": s.live, "seq": s.seq}
                for w, s in sorted(members.workers.items())
            },
            "live": members.live(),
            "barrier": members.released,  # the last barrier generation released
            "barriers": {str(w): s.barrier for w, s in sorted(members.workers.items()) if s.live},
            "duplicates_ignored": consistency.duplicates,
            "pulls_sending": self.pulls.sending,
            "workers_dropped": members.dropped,
            "identity_refused": members.identity_refused,
            "jobs_refused": job.jobs_refused,
            "owner": _owner_said(job.owner),
            "unauthorized_refused": job.unauthorized,
            "job_held_bytes": dict(self.budget.held),
            "checkpoint": {"restored": self.state.restored_from, "skipped": self.state.skipped},
            "staleness": {str(k): v for k, v in sorted(consistency.staleness.items())},
            "max_staleness": max(consistency.staleness, default=0),
        }

    def free(self) -> None:
        """Let go of everything the job holds (it ended); its counters stay readable."""
        self.gradients.close()
        self.pulls.close()
        self.job.free()
        self.budget.clear()
        self.job.shutdown(wait=False)


class Jobs:
    """The server's jobs by id (see the module doc); implements ps/server/replica.py ``Holder``."""

    def __init__(
        self, make: Callable[[str], JobRun], *, max_jobs: int = DEFAULT_MAX_JOBS, keep_jobs: bool = False
    ) -> None:
        if max_jobs < 1:
            raise ValueError("max_jobs must be at least 1")
        self._make = make
        self.max_jobs = max_jobs
        self.keep_jobs = keep_jobs
        self.runs: dict[str, JobRun] = {}
        self.refused = 0  # new job ids refused: max_jobs were held
        self.ended: deque[dict[str, Any]] = deque(maxlen=max_jobs)  # records of ended jobs, newest last
        self.last: JobRun | None = None  # the job that ended last (its counters: ParamServer.step...)
        # The sessions of the workers live in a job ended by force: their requests get an error
        # naming the end (not a fresh job). Bounded: the last max_jobs such jobs.
        self._forced: deque[tuple[str, frozenset[int]]] = deque(maxlen=max_jobs)

    def __iter__(self) -> Iterator[JobRun]:
        return iter(list(self.runs.values()))

    def __len__(self) -> int:
        return len(self.runs)

    def get(self, job_id: str) -> JobRun | None:
        return self.runs.get(job_id)

    def open(self, job_id: str, *, limit: bool = True) -> JobRun:
        """The job ``job_id``, made if it is new (``limit``: only while fewer than ``max_jobs``
        are held; a replica follows its primary without it)."""
        run = self.runs.get(job_id)
        if run is not None:
            return run
        wps.check_job_id(job_id)
        if limit and len(self.runs) >= self.max_jobs:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # the first, then powers of two
                event(log, logging.WARNING, "a new job was refused: the server holds --max-jobs jobs",
                      job=job_id, max_jobs=self.max_jobs, refused=self.refused)  # fmt: skip
            raise LimitExceeded(
                f"this parameter server holds {len(self.runs)} jobs, its --max-jobs: job {job_id!r} "
                "cannot start until one ends (tensorwire ps end JOB) or on a server with more room"
            )
        run = self.runs[job_id] = self._make(job_id)
        log.info("job %s opened (%d held)", job_id, len(self.runs))
        return run

    def prune(self, run: JobRun) -> None:
        """Drop a job a request opened but left empty (a refused join or init)."""
        if run.empty and self.runs.get(run.id) is run:
            del self.runs[run.id]
            run.free()

    def check_not_ended(self, job_id: str, incarnation: int) -> None:
        """ProtocolError for a worker of a job ended by force (it must not start a fresh one)."""
        for ended, sessions in self._forced:
            if ended == job_id and incarnation in sessions:
                raise ProtocolError(
                    f"job {job_id!r} was ended by `tensorwire ps end --force` while this worker was live"
                )

    def done(self, run: JobRun) -> bool:
        """Whether a final leave ends ``run`` now: its work is done, and jobs are not kept."""
        return not self.keep_jobs and self.runs.get(run.id) is run and run.members.finished()

    async def end(self, run: JobRun, why: str, *, force: bool = False) -> None:
        """End ``run`` (see the module doc). Inside the replica's order of changes."""
        if self.runs.get(run.id) is not run:
            return
        if force:
            sessions = frozenset(s.incarnation for s in run.members.workers.values() if s.live)
            self._forced.append((run.id, sessions))
        del self.runs[run.id]
        run.consistency.close(why)
        await run.members.stop()
        policy = run.state.policy
        if policy is not None and run.job.config is not None:
            try:
                await run.state.write_checkpoint()
                retired = await run.job.run(checkpoint.retire, policy.directory)
                log.info("job %s: its checkpoints moved to %s", run.id, retired)
            except PersistenceError as exc:  # the job ends anyway: its memory is freed
                event(log, logging.ERROR, "the last checkpoint of an ended job failed", job=run.id,
                      error=str(exc))  # fmt: skip
        record = run.stats()
        record["workers"] = dict(list(record["workers"].items())[:MAX_RECORDED_WORKERS])
        record["ended"] = why
        self.ended.append(record)
        self.last = run
        run.free()
        event(log, logging.INFO, "job ended", job=run.id, why=why, step=run.job.step, version=run.job.version)

    async def close(self) -> None:
        """The server is stopping: every job's last checkpoint, then their watchdogs and threads."""
        for run in self:
            await run.members.stop()
            if run.state.policy is not None and run.job.config is not None:
                await run.state.write_checkpoint()
            run.job.shutdown()

    # -- the state transfer (ps/server/replica.py Holder) ----------------------------------------------
    def take_all(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Every job's state and tensors; a job's tensors are named ``<its index>:<name>``."""
        order: list[list[Any]] = []
        tensors: dict[str, torch.Tensor] = {}
        for i, run in enumerate(self):
            snapshot = run.state.take(live=True)
            order.append([run.id, snapshot.state])
            tensors.update({f"{i}:{k}": t for k, t in snapshot.params.items()})
            tensors.update({f"{i}:@optimizer/{k}": t for k, t in snapshot.optimizer.items()})
        return {"jobs": order}, tensors

    async def load_all(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Make a primary's state transfer this server's jobs; those it does not name are dropped
        (they ended on the primary while this backup was away; their checkpoints stay)."""
        named = {job_id for job_id, _ in state["jobs"]}
        for run in self:
            if run.id not in named:
                del self.runs[run.id]
                run.consistency.close("ended on the primary")
                await run.members.stop()
                run.free()
        for i, (job_id, job_state) in enumerate(state["jobs"]):
            mine = {k.partition(":")[2]: t for k, t in tensors.items() if k.partition(":")[0] == str(i)}
            optimizer = {
                k.removeprefix("@optimizer/"): t for k, t in mine.items() if k.startswith("@optimizer/")
            }
            params = {k: t for k, t in mine.items() if not k.startswith("@optimizer/")}
            run = self.open(job_id, limit=False)
            run.state.load(checkpoint.Snapshot(job_state, params, optimizer))
            run.consistency.notify()

    def promoted(self) -> None:
        now = time.monotonic()
        for run in self:
            for member in run.members.workers.values():
                member.heard = now
            run.members.start_watchdog()

    def describe(self) -> str:
        runs = list(self)
        said = ", ".join(f"{r.id} at step {r.job.step}, version {r.job.version}" for r in runs[:8])
        return said + (f" and {len(runs) - 8} more" if len(runs) > 8 else "") if runs else "no job"

    # -- checkpoints at start -------------------------------------------------------------------
    def restore_all(self, root: Path) -> list[str]:
        """Load every job's newest complete checkpoint under ``root`` (``<root>/<job id>``); the ids
        restored. PersistenceError for checkpoints of a release before jobs (at ``root`` itself:
        they name the directory to move them to) or more job directories than ``max_jobs``."""
        if checkpoint.has_checkpoints(root):
            snapshot = checkpoint.load(root)
            config = JobConfig.from_json(json.dumps(snapshot.state["config"])) if snapshot else None
            where = root / default_job_id(config.model, config.mode) if config and config.model else None
            raise PersistenceError(
                f"{root} holds checkpoints of a release before jobs: move its ckpt-* directories into "
                f"the directory of their job, {where or f'{root}/<job id>'}, and start again"
            )
        names = sorted(_job_directories(root))
        if len(names) > self.max_jobs:
            raise PersistenceError(
                f"{root} holds the checkpoints of {len(names)} jobs, more than --max-jobs {self.max_jobs}: "
                "raise --max-jobs, or move some to its _ended directory"
            )
        restored = []
        for name in names:
            run = self.open(name, limit=False)
            directory = run.state.policy.directory if run.state.policy else root / name
            if run.state.restore(directory):
                restored.append(name)
            else:  # a directory without checkpoints (an empty one, a job that never wrote one)
                del self.runs[name]
                run.free()
        return restored


def _owner_said(owner: bytes | None) -> str:
    """Who owns a job, for PS_STATS: never the digest itself."""
    return "unclaimed" if owner is None else "job token" if owner else "open"


def _job_directories(root: Path) -> Iterator[str]:
    """The names under ``root`` that are job ids and directories (never a symbolic link)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for item in os.scandir(root):
            if item.is_dir(follow_symlinks=False) and not item.is_symlink():
                with contextlib.suppress(ValueError):
                    yield wps.check_job_id(item.name)
