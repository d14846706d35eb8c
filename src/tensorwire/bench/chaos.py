"""Chaos benchmark: training through replicated parameter servers while processes are killed.

Two server slots, each a primary and a backup process (``--backup``/``--standby`` of each other,
sharing a peer token per slot), and two worker processes train a small MLP in ``sync`` mode on
data that depends only on (rank, step): one fixed rule with 20% of the labels random, the same at
every step. Every ``--interval`` seconds (default 20) a random server or worker is killed with
SIGKILL and started again (a server as a standby on its port, which the slot's primary brings up
to date; a worker with its rank, which rejoins at the job's step). The same job runs once without
faults. ``--token``: every server also requires a client token (``--token-file``) and the job
has an owner (a job token its workers share, which every failover must carry), so that the
replicas must authenticate to each other with their peer token (a primary that could not would
lose acknowledged updates at the next failover, which ``lost_updates`` counts).

Reported (``--json``): ``faults_injected``; ``throughput_ratio`` (samples/s with faults over
without); ``final_loss_delta`` (relative difference of the final loss, each the mean over
``EVAL_BATCHES`` held-out batches of data no worker trains on);
``failover_p50_s`` / ``failover_max_s`` (from killing a slot's primary to that slot's next step on
its backup); ``lost_updates`` (pushes a worker saw acknowledged that its slot does not hold) and
``duplicate_updates`` (pushes applied more than once: applied minus distinct sequence numbers).

Run: ``tensorwire bench chaos --minutes 3 [--token] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tensorwire.ps.launch import free_port, replica_flags
from tensorwire.ps.worker.rpc import JOB_TOKEN_ENV
from tensorwire.security import TOKEN_ENV, load_token, write_token_file
from tensorwire.server.process import ServerProcess, wait_for

SLOTS = WORKERS = 2
BATCH = 32
NOISE = 0.2
EVAL_BATCHES = 8  # held-out batches the final loss averages over (ranks that never train)
EVAL_SIZE = 1024
HELD_OUT_RANK = 10_000
SERVER_FLAGS = ["--heartbeat-timeout", "1", "--failover-timeout", "1"]  # workers beat every 0.25 s


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def batch(rank: int, step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable rule (the largest of the first ten features) with 20% of the labels random: the
    loss settles at the labels' entropy (~0.9) as real data's does, so the runs with and without
    faults compare at convergence rather than at a point on a steep curve."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, 64, generator=gen)
    y = x[:, :10].argmax(1)
    noisy = torch.rand(size, generator=gen) < NOISE
    return x, torch.where(noisy, torch.randint(0, 10, (size,), generator=gen), y)


def eval_loss(net: torch.nn.Module) -> float:
    """The mean of the losses on ``EVAL_BATCHES`` held-out batches (of ranks that never train):
    8,192 samples of the same rule, so the figure is the model's loss, not one batch's luck."""
    losses = []
    with torch.no_grad():
        for i in range(EVAL_BATCHES):
            x, y = batch(HELD_OUT_RANK + i, 0, EVAL_SIZE)
            losses.append(float(F.cross_entropy(net(x), y)))
    return statistics.mean(losses)


# -- the worker process ----------------------------------------------------------------------------
def worker_main(servers: str, steps: int, out: Path) -> None:
    """Train until the job reaches ``steps``, starting at the job's step (a restarted worker)."""
    from tensorwire.ps import SGD, Worker

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    net = model()
    acked = 0
    with Worker(net, servers, "sync", SGD(lr=0.05, momentum=0.9), timeout=120, heartbeat=0.25) as worker:
        step = worker.clock
        while step < steps:
            x, y = batch(rank, step)
            loss: torch.Tensor = F.cross_entropy(net(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            result = worker.step()
            acked += not result.rejoined
            step = worker.clock
            report = {"step": step, "seqs": [slot.seq for slot in worker._slots], "acked": acked}
            _write(out / f"rank{rank}.json", report)
    _write(out / f"rank{rank}.done", {"loss": eval_loss(net)})


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


# -- the controller --------------------------------------------------------------------------------
@dataclass
class Cluster:
    """Server slots (primary, backup) and worker processes, restartable on their addresses."""

    steps: int
    out: Path  # a private temporary directory (0700): the token files are written there too
    token: bool = False  # every server requires a client token as well (--token-file)
    slots: list[list[ServerProcess]] = field(default_factory=list)
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    client_token: str | None = None  # what workers and the controller offer (with ``token``)
    # With ``token`` the job has an owner too (ps/job.py): restarted workers rejoin with it, and the
    # servers must carry it through every failover and state transfer or the rejoin is refused.
    job_token: str | None = None
    flags: list[str] = field(default_factory=list)  # every server's

    def start(self) -> None:
        self.flags = list(SERVER_FLAGS)
        if self.token:
            path = write_token_file(self.out / "client.token")
            self.client_token = load_token(path)
            self.flags += ["--token-file", str(path)]
            self.job_token = secrets.token_hex(24)
        for number in range(SLOTS):
            # Each knows the other: the backup replicates to its old primary once it takes over.
            urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
            peer = write_token_file(self.out / f"slot{number}.peer")
            backup = ServerProcess(urls[1], extra=[*replica_flags(urls, 1, peer), *self.flags])
            primary = ServerProcess(urls[0], extra=[*replica_flags(urls, 0, peer), *self.flags])
            self.slots.append([primary, backup])
        for rank in range(WORKERS):
            self.start_worker(rank)

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
        cmd = [sys.executable, "-m", "tensorwire.bench.chaos", "--worker", self.servers, str(self.steps),
               str(self.out)]  # fmt: skip
        self.workers[rank] = subprocess.Popen(cmd, env=env)

    def restart_server(self, slot: int, index: int) -> None:
        old = self.slots[slot][index]
        peer = self.slots[slot][1 - index].url
        old.stop(5)
        flags = ["--standby", "--backup", peer, "--peer-token-file", str(self.out / f"slot{slot}.peer")]
        self.slots[slot][index] = ServerProcess(old.url, extra=[*flags, *self.flags])

    def stats(self, url: str) -> dict[str, Any] | None:
        """A server's PS_STATS answer, or None if it does not answer (killed, starting)."""
        from tensorwire.ps.worker.rpc import server_stats

        try:
            return server_stats([url], timeout=2, token=self.client_token)[0]
        except Exception:
            return None

    def done(self) -> bool:
        return all((self.out / f"rank{r}.done").exists() for r in range(WORKERS))

    def stop(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for slot in self.slots:
            for server in slot:
                server.stop(5)


def run(
    steps: int, interval: float | None, seed: int = 0, *, token: bool = False, primaries: bool = False
) -> dict[str, Any]:
    """One training run; with ``interval``, a fault every ``interval`` seconds (``primaries``: each
    kills a slot's primary, so that every fault is a failover); ``token``: every server requires
    a client token too."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tensorwire-chaos-") as tmp:
        cluster = Cluster(steps, Path(tmp), token)
        failovers: list[float] = []
        faults = 0
        try:
            cluster.start()
            # The clock starts at the first step of both workers: process start-up is not training.
            while (first := _first_step(cluster)) is None:
                _check_workers(cluster)
                time.sleep(0.05)
            start = time.monotonic()
            next_fault = start + (interval or 0)
            while not cluster.done():
                _check_workers(cluster)
                if interval is not None and time.monotonic() >= next_fault:
                    targets = _targets(cluster, primaries)
                    if not targets:  # none may fail now (a slot is catching up): try again shortly
                        next_fault = time.monotonic() + 0.2
                        continue
                    failover = _inject(cluster, rng.choice(targets))
                    faults += 1
                    if failover is not None:
                        failovers.append(failover)
                    next_fault = time.monotonic() + interval
                time.sleep(0.05)
            seconds = time.monotonic() - start
            result = _account(cluster, seconds, faults, failovers)
            result["samples_per_s"] = (steps - first) * WORKERS * BATCH / seconds
        finally:
            cluster.stop()
    return result


def _first_step(cluster: Cluster) -> int | None:
    """The job's step once both workers have taken one, else None."""
    steps = []
    for rank in range(WORKERS):
        path = cluster.out / f"rank{rank}.json"
        if not path.exists():
            return None
        steps.append(json.loads(path.read_text())["step"])
    return int(min(steps))


def _check_workers(cluster: Cluster) -> None:
    for rank, proc in cluster.workers.items():
        if proc.poll() not in (None, 0):
            raise RuntimeError(f"worker {rank} failed with exit code {proc.returncode}")


Target = tuple[str, int, int]  # ("worker", rank, 0) or ("server", slot, index)


def _targets(cluster: Cluster, primaries: bool) -> list[Target]:
    """What may be killed now: any worker (not with ``primaries``), and a server only while its
    peer holds the job (one failure at a time per slot, as one replica promises: a restarted peer
    that has not had its state transfer yet would lose it)."""
    targets: list[Target] = []
    if not primaries:
        targets += [("worker", r, 0) for r, p in cluster.workers.items() if p.poll() is None]
    for slot in range(SLOTS):
        for i in range(2):
            if primaries and (cluster.stats(cluster.slots[slot][i].url) or {}).get("role") != "primary":
                continue
            if _peer_ready(cluster, slot, i):
                targets.append(("server", slot, i))
    return targets


def _inject(cluster: Cluster, target: Target) -> float | None:
    """Kill -9 ``target``, start it again; the failover time if a primary died."""
    kind, a, b = target
    if kind == "worker":
        proc = cluster.workers[a]
        proc.kill()
        proc.wait()
        if not (cluster.out / f"rank{a}.done").exists():
            cluster.start_worker(a)
        return None
    server = cluster.slots[a][b]
    before = cluster.stats(server.url)
    was_primary = before is not None and before["role"] == "primary"
    step_at_kill = max((s["step"] for s in map(cluster.stats, (x.url for x in cluster.slots[a])) if s),
                       default=0)  # fmt: skip
    killed = time.monotonic()
    server.proc.kill()
    cluster.restart_server(a, b)
    if not was_primary:
        return None
    peer = cluster.slots[a][1 - b].url

    def stepped() -> bool:
        doc = cluster.stats(peer)
        return doc is not None and doc["role"] == "primary" and doc["step"] > step_at_kill

    def over() -> bool:
        _check_workers(cluster)  # a worker that died meanwhile says why now, not after the wait
        return stepped() or cluster.done()

    try:
        wait_for(over, 120, f"slot {a}'s backup to take over")
    except TimeoutError as exc:  # what each server says, for whoever reads the failure
        exc.add_note(_snapshot(cluster))
        raise
    return time.monotonic() - killed


def _snapshot(cluster: Cluster) -> str:
    """Each server's role, epoch, step and jobs (one line each), for a failure's message."""
    lines = []
    for number, slot in enumerate(cluster.slots):
        for server in slot:
            doc = cluster.stats(server.url) or {}
            keys = ("role", "epoch", "step", "version", "jobs", "ended", "workers")
            lines.append(f"slot {number} {server.url}: {json.dumps({k: doc.get(k) for k in keys})[:600]}")
    return "\n".join(lines)


def _peer_ready(cluster: Cluster, slot: int, index: int) -> bool:
    mine, peer = (
        cluster.stats(cluster.slots[slot][index].url),
        cluster.stats(cluster.slots[slot][1 - index].url),
    )
    if mine is None or peer is None or not peer["shards"]:
        return False
    return bool(peer["role"] == "primary" or peer["version"] >= mine["version"] - 5)


def _final_primary(cluster: Cluster, slot: int, deadline: float = 30.0) -> dict[str, Any]:
    """The slot's primary of the highest epoch once training is over. A loaded machine may leave a
    STATUS unanswered for the 2 s ``stats`` waits, or a restarted server still starting: asked
    again until ``deadline`` s, then the error names every server's state.

    A primary killed as training ended has no successor: a backup takes over when a worker asks
    it to, and none is left to ask. Then every server answers and none is primary, and the
    slot's record is its replica of the highest epoch and version that holds the workers' marks
    (what a takeover would serve): that one is accounted."""
    end = time.monotonic() + deadline
    while True:
        docs = [cluster.stats(server.url) for server in cluster.slots[slot]]
        primaries = [doc for doc in docs if doc and doc["role"] == "primary"]
        if primaries:
            return max(primaries, key=lambda d: d["epoch"])
        holding = [doc for doc in docs if doc and doc.get("workers")]
        if cluster.done() and all(docs) and holding:
            return max(holding, key=lambda d: (d["epoch"], d["version"]))
        if time.monotonic() > end:
            raise RuntimeError(f"slot {slot} has no primary at the end:\n{_snapshot(cluster)}")
        time.sleep(0.2)


def _account(cluster: Cluster, seconds: float, faults: int, failovers: list[float]) -> dict[str, Any]:
    reports = [json.loads((cluster.out / f"rank{r}.json").read_text()) for r in range(WORKERS)]
    losses = [json.loads((cluster.out / f"rank{r}.done").read_text())["loss"] for r in range(WORKERS)]
    lost = duplicates = 0
    for slot_index in range(len(cluster.slots)):
        doc = _final_primary(cluster, slot_index)
        marks = {int(w): s["seq"] for w, s in doc["workers"].items()}
        lost += sum(max(0, r["seqs"][slot_index] - marks.get(rank, 0)) for rank, r in enumerate(reports))
        duplicates += max(0, doc["pushes_applied"] - sum(marks.values()))
    return {
        "seconds": seconds,
        "loss": statistics.mean(losses),
        "faults_injected": faults,
        "failovers": failovers,
        "lost_updates": lost,
        "duplicate_updates": duplicates,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="tensorwire bench chaos", description=__doc__)
    parser.add_argument("--minutes", type=float, default=3.0, help="length of the run with faults")
    parser.add_argument("--interval", type=float, default=20.0, help="seconds between faults")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument(
        "--token",
        action="store_true",
        help="every server requires a client token (and replicas a peer token)",
    )
    parser.add_argument("--worker", nargs=3, metavar=("SERVERS", "STEPS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        servers, steps, out = args.worker
        worker_main(servers, int(steps), Path(out))
        return {}
    probe = run(300, None, token=args.token)  # how fast the job runs here, to size the runs to --minutes
    steps = max(100, int(probe["samples_per_s"] / (WORKERS * BATCH) * args.minutes * 60))
    calm = run(steps, None, token=args.token)
    chaos = run(steps, args.interval, token=args.token)
    failovers = sorted(chaos["failovers"])
    result = {
        "minutes": args.minutes,
        "token": args.token,
        "steps": steps,
        "faults_injected": chaos["faults_injected"],
        "throughput_ratio": chaos["samples_per_s"] / calm["samples_per_s"],
        "final_loss_delta": abs(chaos["loss"] - calm["loss"]) / calm["loss"],
        "failover_p50_s": statistics.median(failovers) if failovers else None,
        "failover_max_s": max(failovers) if failovers else None,
        "failovers_measured": len(failovers),
        "lost_updates": chaos["lost_updates"],
        "duplicate_updates": chaos["duplicate_updates"],
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
