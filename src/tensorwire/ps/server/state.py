"""One job's state as a whole: taken for a checkpoint or a state transfer, loaded from one, and
when checkpoints are written.

``take`` gathers the job (its config, shards, optimizer state, counters, and the workers' clocks
and push marks, so a restored server still recognises a resent push) into a
``checkpoint.Snapshot``; ``live`` adds what a backup taking over needs beyond a checkpoint: the
workers' liveness (and whether each left for good), read clocks and incarnations, and the pushes
of a sync step not taken yet.
``load`` makes such a snapshot the job. ps/server/checkpoint.py writes and reads snapshots on disk
(all or nothing); ps/server/jobs.py gathers every job's for a state transfer, which ps/server/replica.py sends
and receives (SYNC). A job that has workers but no parameters yet (joined, not initialised) is
taken and loaded too: its config is then None.

Lifecycle: ``State`` is made with its job, with the job's ``CheckpointPolicy`` (its directory
is the job's own, under the server's ``--checkpoint-dir``; or None: no checkpoints). After each
update the modes call ``maybe_checkpoint``; the job's end and the server's close write a last one
(``write_checkpoint``); ``restore`` (``tensorwire serve`` at start, PS_ROLLBACK) loads one.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tensorwire.logs import event
from tensorwire.ps.job import CheckpointPolicy, HeldShard, Job, JobConfig
from tensorwire.ps.server import checkpoint
from tensorwire.ps.server.gradients import Gradients, Grads
from tensorwire.ps.server.membership import Member, Members

log = logging.getLogger("tensorwire.ps")


class State:
    """Snapshots of the job, and its checkpoints (see the module doc)."""

    def __init__(
        self, policy: CheckpointPolicy | None, job: Job, members: Members, gradients: Gradients
    ) -> None:
        self.policy = policy
        self._job = job
        self._members = members
        self._gradients = gradients
        self.restored_from: str | None = None  # the checkpoint this server's job came from
        self.skipped = 0  # newer checkpoints passed over at a restore: not complete
        self._last_checkpoint = time.monotonic()

    def take(self, *, live: bool = False) -> checkpoint.Snapshot:
        """The job's state; ``live`` adds what a backup taking over needs beyond a checkpoint: the
        workers' liveness and read clocks and the pushes of a sync step not taken yet."""
        job, workers = self._job, self._members.workers
        tensors, optimizer_rest = (
            checkpoint.optimizer_tensors(job.optimizer.state_dict())
            if job.optimizer is not None
            else ({}, {})
        )
        state: dict[str, Any] = {
            "config": json.loads(job.config.to_json()) if job.config is not None else None,
            "shards": list(job.shards),
            "versions": {key: shard.version for key, shard in job.shards.items()},
            "world": job.world,
            "step": job.step,
            "version": job.version,
            "pushes": job.pushes,
            "workers": {str(w): [s.clock, s.seq, s.last_reply.hex()] for w, s in workers.items()},
            "optimizer": optimizer_rest,
            "owner": job.owner.hex() if job.owner is not None else None,  # its token's digest, "": open
        }
        params = {key: shard.param.detach() for key, shard in job.shards.items()}
        if live:
            state["live"] = {str(w): [s.live, s.read_clock, s.incarnation, s.barrier, s.finished]
                             for w, s in workers.items()}  # fmt: skip
            state["released"] = self._members.released
            state["pending"] = {}
            for clock, pending in self._gradients.pending.items():
                for worker, (_, grads) in pending.grads.items():
                    present = [i for i, g in enumerate(grads) if g is not None]
                    state["pending"].setdefault(str(clock), {})[str(worker)] = present
                    for i in present:
                        grad = grads[i]
                        assert grad is not None
                        params[f"@pending/{clock}/{worker}/{i}"] = grad
        return checkpoint.Snapshot(state, params, tensors)

    def load(self, snapshot: checkpoint.Snapshot) -> None:
        """Make ``snapshot`` this server's job (a checkpoint: its workers not live; a backup's
        state transfer: as they are on the primary, pending pushes included)."""
        job, state = self._job, snapshot.state
        config = JobConfig.from_json(json.dumps(state["config"])) if state["config"] is not None else None
        shards = {key: HeldShard(key, torch.nn.Parameter(snapshot.params[key]), state["versions"][key])
                  for key in state["shards"]}  # fmt: skip
        optimizer = config.optimizer.build(s.param for s in shards.values()) if config else None
        if optimizer is not None:
            optimizer.load_state_dict(checkpoint.optimizer_state(snapshot.optimizer, state["optimizer"]))
        job.config, job.shards, job.optimizer = config, shards, optimizer
        job.owner = _owner(state.get("owner"))
        job.generation += 1
        job.world, job.step, job.version, job.pushes = (
            state["world"],
            state["step"],
            state["version"],
            state["pushes"],
        )
        workers = {int(w): Member(clock, False, clock, seq=seq, last_reply=bytes.fromhex(reply))
                   for w, (clock, seq, reply) in state["workers"].items()}  # fmt: skip
        for w, (live, read_clock, incarnation, barrier, finished) in state.get("live", {}).items():
            worker = workers[int(w)]
            worker.live, worker.read_clock, worker.incarnation, worker.barrier = (
                live,
                read_clock,
                incarnation,
                barrier,
            )
            worker.finished = finished  # left for good: a backup taking over ends the job as it would
        self._members.workers = workers
        self._members.released = state.get("released", 0)
        if config is not None:
            job.count()
        pending: dict[int, dict[int, Grads]] = {}
        for clock, by_worker in state.get("pending", {}).items():
            for w, present in by_worker.items():
                grads: Grads = [None] * len(shards)
                for i in present:
                    grads[i] = snapshot.params[f"@pending/{clock}/{w}/{i}"]
                pending.setdefault(int(clock), {})[int(w)] = grads
        self._gradients.replace(pending)

    # -- checkpoints ----------------------------------------------------------------------------
    async def maybe_checkpoint(self) -> None:
        policy = self.policy
        if policy is None:
            return
        by_steps = policy.every_steps and self._job.version % policy.every_steps == 0
        by_time = policy.every_seconds and time.monotonic() - self._last_checkpoint >= policy.every_seconds
        if by_steps or by_time:
            await self.write_checkpoint()

    async def write_checkpoint(self) -> None:
        """Write the job's state. It runs on the optimizer's thread, after the step that made it,
        so no step changes the parameters while they are written (pulls only read them)."""
        assert self.policy is not None
        job = self._job
        async with job.lock.exclusive():  # no step in between: the counters match the tensors
            snapshot = self.take()
            path = await job.run(checkpoint.save, self.policy.directory, job.version, snapshot)
        self._last_checkpoint = time.monotonic()
        log.info("checkpoint %s written (step %d, version %d)", path, job.step, job.version)

    def restore(self, directory: Path, version: int | None = None) -> bool:
        """Load the newest complete checkpoint (of ``version``, if given) of ``directory``, if there
        is one; newer ones that are not complete (torn by a crash) are skipped, and that is said in
        the log and in ``stats()["checkpoint"]``. Its workers come back as not live: each rejoins
        (``ps.Worker`` does it by itself)."""
        snapshot = checkpoint.load(directory, version)
        if snapshot is None:
            return False
        self.restored(snapshot)
        return True

    def restored(self, snapshot: checkpoint.Snapshot) -> None:
        """Make a checkpoint read by ``checkpoint.load`` the job, and say where it came from."""
        self.load(snapshot)
        assert snapshot.path is not None
        job = self._job
        self.restored_from = snapshot.path.name
        self.skipped += len(snapshot.skipped)
        if snapshot.skipped:
            event(log, logging.WARNING, "restored an older checkpoint: the newer ones are not complete",
                  restored=str(snapshot.path), skipped=len(snapshot.skipped), step=job.step)  # fmt: skip
        log.info("restored checkpoint %d of %s (step %d)", job.version, snapshot.path.parent, job.step)


def _owner(said: object) -> bytes | None:
    """A job's owner as a checkpoint or a state transfer keeps it (hex; None in one written before
    job tokens: the first worker to rejoin claims it)."""
    if said is None:
        return None
    if not isinstance(said, str) or len(said) not in (0, 64):
        raise ValueError(f"a job's owner is a hex SHA-256 digest or empty, not {str(said)[:80]!r}")
    return bytes.fromhex(said)
