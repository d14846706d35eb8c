"""The processes of ``tensorwire bench chaos`` and the faults it injects into them.

``Cluster``: two server slots (a primary and a backup process each, ``--backup``/``--standby`` of
each other with a peer token per slot; with a coordinator, also ``--coordinator URL --slot
slotN --lease-ttl TTL``, so that the slot's etcd lease decides its primary) and the worker
processes, each restartable on its address. ``targets`` says what may fail now, ``inject`` makes
one fail and measures the failover it causes. The fault kinds:

* ``worker``: a worker killed (SIGKILL) and started again with its rank; it rejoins at the job's step.
* ``kill``: a server killed (SIGKILL) and started again as a standby on its port, which the slot's
  primary brings up to date. A primary's is a failover.
* ``partition`` (with a coordinator): a primary stopped (SIGSTOP) for longer than the lease's ttl,
  then continued: cut off from everyone, without needing network namespaces. Its backup takes the
  lease meanwhile; awake, it must find its term gone, step down and follow the new primary.

Lifecycle: ``Cluster(...)``, ``start()``, any number of ``inject(cluster, target)`` with a target
``targets(cluster, ...)`` gave (``Spared`` if it is no longer one), ``stop()`` once (also after an
error).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tensorwire._aio import within
from tensorwire.coordinator import Leader, open_coordinator
from tensorwire.errors import TensorwireError
from tensorwire.ps.launch import free_port, replica_flags
from tensorwire.ps.worker.leaders import COORDINATOR_ENV
from tensorwire.ps.worker.rpc import JOB_TOKEN_ENV
from tensorwire.security import TOKEN_ENV, load_token, write_token_file
from tensorwire.server.process import ServerProcess, wait_for

SLOTS = WORKERS = 2
SERVER_FLAGS = ["--heartbeat-timeout", "1", "--failover-timeout", "1"]  # workers beat every 0.25 s
DEFAULT_LEASE_TTL = 3.0
FAILOVER_WAIT = 120.0  # seconds a failover may take before the run fails, naming every server's state
PAUSE_PAST_TTL = 1.0  # a partition lasts the lease's ttl and this much more (from SIGSTOP to SIGCONT)
# A woken primary steps down at its next renewal or request; the wait for it (ttl + this) is generous.
STEP_DOWN_WAIT = 30.0


@dataclass
class Cluster:
    """Server slots (primary, backup) and worker processes, restartable on their addresses."""

    steps: int
    out: Path  # a private temporary directory (0700): the token files are written there too
    token: bool = False  # every server requires a client token as well (--token-file)
    coordinator: str | None = None  # an etcd URL: the slots' leases decide their primaries
    lease_ttl: float = DEFAULT_LEASE_TTL
    slots: list[list[ServerProcess]] = field(default_factory=list)
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    client_token: str | None = None  # what workers and the controller offer (with ``token``)
    # With ``token`` the job has an owner too (ps/job.py): restarted workers rejoin with it, and the
    # servers must carry it through every failover and state transfer or the rejoin is refused.
    job_token: str | None = None
    flags: list[str] = field(default_factory=list)  # every server's
    leases: Leases | None = None  # the coordinator's word on each slot's leader (with a coordinator)

    def start(self) -> None:
        self.flags = list(SERVER_FLAGS)
        if self.coordinator is not None:
            self.leases = Leases(self.coordinator)
        if self.token:
            path = write_token_file(self.out / "client.token")
            self.client_token = load_token(path)
            self.flags += ["--token-file", str(path)]
            self.job_token = secrets.token_hex(24)
        for number in range(SLOTS):
            # Each knows the other: the backup replicates to its old primary once it takes over.
            # With a coordinator the first campaigns first (the second, --standby, waits one ttl).
            urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
            peer = write_token_file(self.out / f"slot{number}.peer")
            extra = [*self.flags, *self.lease_flags(number)]
            backup = ServerProcess(urls[1], extra=[*replica_flags(urls, 1, peer), *extra])
            primary = ServerProcess(urls[0], extra=[*replica_flags(urls, 0, peer), *extra])
            self.slots.append([primary, backup])
        for rank in range(WORKERS):
            self.start_worker(rank)

    def lease_flags(self, slot: int) -> list[str]:
        """The ``ps serve`` flags that put a replica of ``slot`` under the coordinator's lease."""
        if self.coordinator is None:
            return []
        lease = ["--slot", f"slot{slot}", "--lease-ttl", str(self.lease_ttl)]
        return ["--coordinator", self.coordinator, *lease]

    @property
    def servers(self) -> str:
        return ",".join("|".join(s.url for s in slot) for slot in self.slots)

    def start_worker(self, rank: int) -> None:
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORKERS)}
        token = self.client_token
        if token is not None:
            env[TOKEN_ENV] = token  # ps.Worker reads it
        if self.job_token is not None:
            env[JOB_TOKEN_ENV] = self.job_token
        if self.coordinator is not None:  # workers watch each slot's leader there (ps/worker/leaders.py)
            env[COORDINATOR_ENV] = self.coordinator
        cmd = [sys.executable, "-m", "tensorwire.bench.chaos", "--worker", self.servers, str(self.steps),
               str(self.out)]  # fmt: skip
        self.workers[rank] = subprocess.Popen(cmd, env=env)

    def restart_server(self, slot: int, index: int) -> None:
        old = self.slots[slot][index]
        peer = self.slots[slot][1 - index].url
        old.stop(5)
        flags = ["--standby", "--backup", peer, "--peer-token-file", str(self.out / f"slot{slot}.peer")]
        extra = [*flags, *self.flags, *self.lease_flags(slot)]
        self.slots[slot][index] = ServerProcess(old.url, extra=extra)

    def stats(self, url: str) -> dict[str, Any] | None:
        """A server's PS_STATS answer, or None if it does not answer (killed, stopped, starting)."""
        from tensorwire.ps.worker.rpc import server_stats

        try:
            return server_stats([url], timeout=2, token=self.client_token)[0]
        except Exception:
            return None

    def trained(self, rank: int) -> bool:
        """Whether worker ``rank`` is in (or past) the job's last step: killed now, it would be
        started again after the job ended (its last worker gone) and begin a new one at step 0 that
        waits for a partner that is done. Its report is written when it has joined (a restarted
        worker may join at the last step) and when ``step`` returns, so one that
        says the step before the last may belong to a worker whose last push the servers applied
        already (seen under ``make test``'s load). A file read: the worker is stopped meanwhile, and
        a stop longer than the servers' heartbeat timeout would cost it its place in the job."""
        try:
            report = json.loads((self.out / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(report["step"] >= self.steps - 1)

    def done(self) -> bool:
        return all((self.out / f"rank{r}.done").exists() for r in range(WORKERS))

    def check_workers(self) -> None:
        for rank, proc in self.workers.items():
            if proc.poll() not in (None, 0):
                # Each server's view (role, step, its workers' clocks and liveness) says which side
                # a worker waited on: a pull that timed out under load is otherwise bare.
                failed = f"worker {rank} failed with exit code {proc.returncode}"
                raise RuntimeError(f"{failed}:\n{self.snapshot()}")

    def snapshot(self) -> str:
        """Each server's role, epoch, step and jobs (one line each), for a failure's message."""
        lines = []
        for number, slot in enumerate(self.slots):
            for server in slot:
                doc = self.stats(server.url) or {}
                keys = ("role", "epoch", "step", "version", "jobs", "ended", "workers", "coordinator")
                lines.append(f"slot {number} {server.url}: {json.dumps({k: doc.get(k) for k in keys})[:800]}")
        return "\n".join(lines)

    def stop(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for slot in self.slots:
            for server in slot:
                server.stop(5)  # a stopped (partitioned) one is continued first
        if self.leases is not None:
            self.leases.close()
            self.leases = None


class Leases:
    """Reads each slot's leader key from the controller: one client, on one event loop of its own."""

    def __init__(self, url: str) -> None:
        self._runner = asyncio.Runner()
        self._coordinator = open_coordinator(url)

    def leader(self, slot: int) -> Leader | Exception | None:
        """Slot ``slot``'s leader, None if the key is gone, or the error that kept the read from
        answering (within two seconds)."""
        try:
            return self._runner.run(within(self._coordinator.leader(f"slot{slot}"), 2.0))
        except (TensorwireError, TimeoutError) as exc:
            return exc

    def close(self) -> None:
        self._runner.run(self._coordinator.close())
        self._runner.close()


# -- faults ----------------------------------------------------------------------------------------
class Target(NamedTuple):
    """What a fault hits: ``kind`` (``worker``, ``kill`` or ``partition``), then a worker's rank
    (``slot``; ``replica`` 0), or a server's slot and its replica's index in it."""

    kind: str
    slot: int
    replica: int = 0


@dataclass(frozen=True)
class Failover:
    """A slot's primary failed (``kind``: ``kill`` or ``partition``): ``seconds`` from the fault to
    the slot's next step on its new primary, ``takeover_s`` to the new primary saying so, and
    ``lease_s`` (with a coordinator) to the coordinator no longer naming the failed one (its lease
    ran out, or, for a dead process, its backup revoked it), each as seen by the controller's
    polls every few ms."""

    kind: str
    slot: int
    seconds: float
    takeover_s: float | None
    lease_s: float | None = None


def targets(cluster: Cluster, *, primaries: bool, kind: str | None = None) -> list[Target]:
    """What may fail now: any worker (not with ``primaries``); a server only while its peer holds
    the job (one failure at a time per slot, as one replica promises: a restarted peer that has not
    had its state transfer yet would lose it); with a coordinator, a primary may be partitioned
    too. ``primaries``: only the slots' primaries; ``kind``: only faults of that kind."""
    found: list[Target] = []
    if not primaries:
        found += [Target("worker", r) for r, p in cluster.workers.items() if p.poll() is None
                  and not cluster.trained(r)]  # fmt: skip
    for slot in range(SLOTS):
        for i in range(2):
            role = (cluster.stats(cluster.slots[slot][i].url) or {}).get("role")
            if (primaries and role != "primary") or not _peer_ready(cluster, slot, i):
                continue
            found.append(Target("kill", slot, i))
            if cluster.coordinator is not None and role == "primary":
                found.append(Target("partition", slot, i))
    return [t for t in found if kind is None or t.kind == kind]


def _peer_ready(cluster: Cluster, slot: int, index: int) -> bool:
    """Whether the slot keeps every acknowledged update if replica ``index`` fails now. With a
    coordinator, a backup may take over only if it is in the in-sync set its primary wrote, so
    that set must name the peer (a peer close in version but not yet in it would leave the slot
    down)."""
    mine_url, peer_url = cluster.slots[slot][index].url, cluster.slots[slot][1 - index].url
    mine, peer = cluster.stats(mine_url), cluster.stats(peer_url)
    if mine is None or peer is None or not peer["shards"]:
        return False
    if peer["role"] == "primary":
        return True
    if cluster.coordinator is not None:
        in_sync = (mine.get("coordinator") or {}).get("in_sync") or []
        if mine["role"] != "primary" or peer_url not in in_sync:
            return False
    return bool(peer["version"] >= mine["version"] - 5)


class Spared(Exception):
    """``inject`` did not make its target fail: it was no longer one (a worker that is done)."""


def inject(cluster: Cluster, target: Target) -> Failover | None:
    """Make ``target`` fail (and a killed process start again); the failover if a primary failed.
    Spared if the target turned out not to be one."""
    if target.kind == "worker":
        rank = target.slot
        proc = cluster.workers[rank]
        # Stopped first, and looked at again: ``targets`` read its report a while ago, and a worker
        # that took the last step meanwhile may have left the job for good, which ends it once
        # the other has too; started again it would begin a new job at step 0 and wait there for
        # a partner that is done (seen under ``make test``'s load). Stopped, its report cannot
        # move, and it writes its last step's report before it leaves.
        proc.send_signal(signal.SIGSTOP)
        if cluster.trained(rank):
            proc.send_signal(signal.SIGCONT)
            raise Spared(f"worker {rank} reached the job's last step before it could be killed")
        proc.kill()
        proc.wait()
        if not (cluster.out / f"rank{rank}.done").exists():
            cluster.start_worker(rank)
        return None
    slot, index = target.slot, target.replica
    server = cluster.slots[slot][index]
    before = cluster.stats(server.url)
    was_primary = before is not None and before["role"] == "primary"
    step_at = max((s["step"] for s in map(cluster.stats, (x.url for x in cluster.slots[slot])) if s),
                  default=0)  # fmt: skip
    if target.kind == "partition":
        return _partition(cluster, target, step_at)
    failed = time.monotonic()
    server.proc.kill()
    if not was_primary:
        cluster.restart_server(slot, index)
        return None
    # Started again meanwhile, not first: the failover does not wait for a process to start, and
    # neither may its measure.
    with ThreadPoolExecutor(1) as pool:
        restarted = pool.submit(cluster.restart_server, slot, index)
        failover = _failover(cluster, target, step_at, failed)
        restarted.result()
    return failover


def _partition(cluster: Cluster, target: Target, step_at: int) -> Failover:
    """SIGSTOP the primary for the lease's ttl and ``PAUSE_PAST_TTL`` more, whatever happens
    meanwhile, then SIGCONT it; the failover is measured as a kill's. Awake, it must step down and
    follow the slot's new primary."""
    server = cluster.slots[target.slot][target.replica]
    length = cluster.lease_ttl + PAUSE_PAST_TTL
    # Continued on time even while the failover is still awaited: a worker that keeps trying the
    # stopped primary would otherwise wait for it as long as the controller waits for the worker.
    resume = threading.Timer(length, server.proc.send_signal, (signal.SIGCONT,))
    failed = time.monotonic()
    server.proc.send_signal(signal.SIGSTOP)
    resume.start()
    try:
        failover = _failover(cluster, target, step_at, failed)
        resume.join()  # a fault's length, not a wait for something: the primary stays stopped
    finally:
        resume.cancel()
        server.proc.send_signal(signal.SIGCONT)

    def follows() -> bool:
        doc = cluster.stats(server.url)
        return doc is not None and doc["role"] == "backup"

    what = f"the woken primary {server.url} to step down"
    _wait(cluster, follows, cluster.lease_ttl + STEP_DOWN_WAIT, what)
    return failover


def _failover(cluster: Cluster, target: Target, step_at: int, failed: float) -> Failover:
    """Wait for the slot's other replica to be the primary and take a step past ``step_at``."""
    peer = cluster.slots[target.slot][1 - target.replica].url
    took: list[float] = []
    lease_end: list[float] = []

    def lease_over() -> None:
        if cluster.leases is None or lease_end:
            return
        leader = cluster.leases.leader(target.slot)
        failed_url = cluster.slots[target.slot][target.replica].url
        if not isinstance(leader, Exception) and (leader is None or leader.address != failed_url):
            lease_end.append(time.monotonic() - failed)

    def stepped() -> bool:
        lease_over()
        doc = cluster.stats(peer)
        if doc is None or doc["role"] != "primary":
            return False
        if not took:
            took.append(time.monotonic() - failed)
        return bool(doc["step"] > step_at)

    def over() -> bool:
        cluster.check_workers()  # a worker that died meanwhile says why now, not after the wait
        # With leases, the lease's end must have been read too: a read that failed under load (its
        # 2 s timeout) is made again at the next poll rather than leave the figure out.
        return (stepped() and (cluster.leases is None or bool(lease_end))) or cluster.done()

    _wait(cluster, over, FAILOVER_WAIT, f"slot {target.slot}'s backup to take over")
    seconds = time.monotonic() - failed
    return Failover(target.kind, target.slot, seconds, _first(took), _first(lease_end))


def _first(seen: list[float]) -> float | None:
    return seen[0] if seen else None


def _wait(cluster: Cluster, condition: Any, timeout: float, what: str) -> None:
    try:
        wait_for(condition, timeout, what)
    except TimeoutError as exc:  # what each server says, for whoever reads the failure
        exc.add_note(cluster.snapshot())
        raise
