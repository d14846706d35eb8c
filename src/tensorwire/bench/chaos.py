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

``--coordinator etcd``: the benchmark starts an etcd on loopback (``coordinator.local.LocalEtcd``,
ended with the run) and each slot's primary is the replica holding the slot's lease there
(``ps serve --coordinator URL --slot slotN --lease-ttl``, ``--lease-ttl`` seconds, default 3), as
ps/server/leadership.py describes. The fault mix then has partitions too: a primary stopped
(SIGSTOP) for longer than the ttl and continued, which must step down and follow
(bench/chaos_cluster.py has the faults). Both runs use the same coordinator: the ratio is the
faults' cost alone.

Reported (``--json``): ``faults_injected`` (and ``faults_by_kind``); ``throughput_ratio``
(samples/s with faults over without); ``final_loss_delta`` (relative difference of the final loss,
each the mean over ``EVAL_BATCHES`` held-out batches of data no worker trains on);
``failover_p50_s`` / ``failover_max_s`` (from killing or stopping a slot's primary to that slot's
next step on its new primary; ``failovers`` lists each, with its kind, and ``takeover_s``: to the
new primary saying it is one); ``lost_updates`` (pushes a worker saw acknowledged that its slot
does not hold) and ``duplicate_updates`` (pushes applied more than once: applied minus distinct
sequence numbers); ``coordinator`` and ``lease_ttl`` (null without a coordinator). With a
coordinator each failover also has ``lease_s``, from the fault to etcd no longer naming the failed
primary: the bound of any failover that waits for a lease, measured in the same run (a stopped
primary's lease runs out; a dead one's is revoked by its backup), with its median per kind and the
median of the rest of the failover past it. ``--primaries``: every fault fails a slot's primary
(partitions and kills in turn with a coordinator), so that each is a failover.

Run: ``tensorwire bench chaos --minutes 3 [--token] [--coordinator etcd [--lease-ttl 3]]
[--primaries] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tensorwire.bench.chaos_cluster import (
    DEFAULT_LEASE_TTL,
    WORKERS,
    Cluster,
    Failover,
    Spared,
    inject,
    targets,
)
from tensorwire.coordinator.local import LocalEtcd

BATCH = 32
NOISE = 0.2
EVAL_BATCHES = 8  # held-out batches the final loss averages over (ranks that never train)
EVAL_SIZE = 1024
HELD_OUT_RANK = 10_000
COORDINATORS = ("none", "etcd")
# With ``primaries`` every fault is a failover: these kinds in turn (a partition needs a coordinator).
PRIMARY_FAULTS = ("partition", "kill")


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
    path = out / f"rank{rank}.json"
    with Worker(net, servers, "sync", SGD(lr=0.05, momentum=0.9), timeout=120, heartbeat=0.25) as worker:
        # Reported as soon as it has joined, before any step: a worker started again late joins at
        # the job's step, which may be its last (the other worker trained on alone), and then
        # leaves at once, which ends the job. Until its report says so, the controller would still
        # read its last life's step and may kill it and start it again, into a fresh job at step 0
        # that waits for a partner that is done.
        _write(path, _joined_report(path, worker.clock, [slot.seq for slot in worker._slots]))
        step = worker.clock
        while step < steps:
            x, y = batch(rank, step)
            loss: torch.Tensor = F.cross_entropy(net(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            result = worker.step()
            acked += not result.rejoined
            step = worker.clock
            report = {"step": step, "seqs": [slot.seq for slot in worker._slots], "acked": acked}
            _write(path, report)
    _write(out / f"rank{rank}.done", {"loss": eval_loss(net)})


def _joined_report(path: Path, step: int, seqs: list[int]) -> dict[str, Any]:
    """The report of a worker that has just joined at ``step``: each slot's push sequence number is
    the larger of the server's and the one this rank's last life saw acknowledged (a server that
    lost an acknowledged push must still count as having lost it)."""
    try:
        before = json.loads(path.read_text())["seqs"]
    except (OSError, ValueError, KeyError):
        before = []
    seen = [max(seq, before[i]) if i < len(before) else seq for i, seq in enumerate(seqs)]
    return {"step": step, "seqs": seen, "acked": 0}


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


# -- the controller --------------------------------------------------------------------------------
def run(
    steps: int,
    interval: float | None,
    seed: int = 0,
    *,
    token: bool = False,
    primaries: bool = False,
    coordinator: str = "none",
    lease_ttl: float = DEFAULT_LEASE_TTL,
) -> dict[str, Any]:
    """One training run; with ``interval``, a fault every ``interval`` seconds (``primaries``: each
    fails a slot's primary, so that every fault is a failover: kills, and with a coordinator
    kills and partitions in turn); ``token``: every server requires a client token too;
    ``coordinator="etcd"``: the slots' primaries hold leases of ``lease_ttl`` s in an etcd of the
    run's own."""
    if coordinator not in COORDINATORS:
        raise ValueError(f"coordinator {coordinator!r}: one of {', '.join(COORDINATORS)}")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tensorwire-chaos-") as tmp, _coordinator(coordinator) as url:
        cluster = Cluster(steps, Path(tmp), token, url, lease_ttl)
        try:
            cluster.start()
            # The clock starts once both workers have joined: process start-up is not training.
            while (first := _first_step(cluster)) is None:
                cluster.check_workers()
                time.sleep(0.05)
            start = time.monotonic()
            faults, failovers = _train(cluster, interval, rng, primaries)
            seconds = time.monotonic() - start
            result = _account(cluster, seconds, faults, failovers)
            result["samples_per_s"] = (steps - first) * WORKERS * BATCH / seconds
        finally:
            cluster.stop()  # before etcd ends: a server resigns its lease as it stops
    return result


@contextlib.contextmanager
def _coordinator(name: str) -> Iterator[str | None]:
    """The URL of an etcd of this run's own (ended on leaving, always), or None for ``none``."""
    if name == "none":
        yield None
        return
    with LocalEtcd(prefix="/tensorwire-chaos") as etcd:
        yield etcd.url


def _train(
    cluster: Cluster, interval: float | None, rng: random.Random, primaries: bool
) -> tuple[Counter[str], list[Failover]]:
    """Until the job is done, a fault every ``interval`` s (None: none); the faults by kind and the
    failovers they caused."""
    faults: Counter[str] = Counter()
    failovers: list[Failover] = []
    next_fault = time.monotonic() + (interval or 0)
    while not cluster.done():
        cluster.check_workers()
        if interval is not None and time.monotonic() >= next_fault:
            kind = None
            if primaries and cluster.coordinator is not None:
                kind = PRIMARY_FAULTS[faults.total() % len(PRIMARY_FAULTS)]
            found = targets(cluster, primaries=primaries, kind=kind)
            if not found:  # none may fail now (a slot is catching up): try again shortly
                next_fault = time.monotonic() + 0.2
                continue
            target = rng.choice(found)
            try:
                failover = inject(cluster, target)
            except Spared:
                next_fault = time.monotonic() + 0.2
                continue
            faults[target.kind] += 1
            if failover is not None:
                failovers.append(failover)
            next_fault = time.monotonic() + interval
        time.sleep(0.05)
    return faults, failovers


def _first_step(cluster: Cluster) -> int | None:
    """The job's step once both workers have joined (each reports then), else None."""
    steps = []
    for rank in range(WORKERS):
        path = cluster.out / f"rank{rank}.json"
        if not path.exists():
            return None
        steps.append(json.loads(path.read_text())["step"])
    return int(min(steps))


def _final_primary(cluster: Cluster, slot: int, deadline: float = 30.0) -> dict[str, Any]:
    """The slot's primary of the highest epoch once training is over. A loaded machine may leave a
    STATUS unanswered for the 2 s ``stats`` waits, or a restarted server still starting: asked
    again until ``deadline`` s, then the error names every server's state.

    Without a coordinator, a primary killed as training ended has no successor: a backup takes
    over when a worker asks it to, and none is left to ask. Then every server answers and none is
    primary, and the slot's record is its replica of the highest epoch and version that holds the
    workers' marks (what a takeover would serve): that one is accounted."""
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
            raise RuntimeError(f"slot {slot} has no primary at the end:\n{cluster.snapshot()}")
        time.sleep(0.2)


def _account(
    cluster: Cluster, seconds: float, faults: Counter[str], failovers: list[Failover]
) -> dict[str, Any]:
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
        "faults_injected": faults.total(),
        "faults_by_kind": dict(faults),
        "failovers": [dataclasses.asdict(f) for f in failovers],
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
    parser.add_argument(
        "--coordinator",
        choices=COORDINATORS,
        default="none",
        help="etcd: an etcd of the benchmark's own decides each slot's primary by lease, and "
        "partitions (a primary stopped past the ttl) join the faults (default: none)",
    )
    parser.add_argument(
        "--primaries",
        action="store_true",
        help="every fault fails a slot's primary, so that each is a failover (with etcd: "
        "partitions and kills in turn; default: any server or worker, at random)",
    )
    parser.add_argument(
        "--lease-ttl", type=float, default=DEFAULT_LEASE_TTL, help="seconds of a slot's lease (etcd)"
    )
    parser.add_argument("--worker", nargs=3, metavar=("SERVERS", "STEPS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        servers, steps, out = args.worker
        worker_main(servers, int(steps), Path(out))
        return {}
    options = {"token": args.token, "coordinator": args.coordinator, "lease_ttl": args.lease_ttl}
    faults = {"primaries": args.primaries}
    probe = run(300, None, **options)  # how fast the job runs here, to size the runs to --minutes
    steps = max(100, int(probe["samples_per_s"] / (WORKERS * BATCH) * args.minutes * 60))
    calm = run(steps, None, **options)
    chaos = run(steps, args.interval, **options, **faults)
    result = {
        "minutes": args.minutes,
        "token": args.token,
        "coordinator": args.coordinator,
        "lease_ttl": args.lease_ttl if args.coordinator != "none" else None,
        "primaries": args.primaries,
        "steps": steps,
        "faults_injected": chaos["faults_injected"],
        "faults_by_kind": chaos["faults_by_kind"],
        "throughput_ratio": chaos["samples_per_s"] / calm["samples_per_s"],
        "final_loss_delta": abs(chaos["loss"] - calm["loss"]) / calm["loss"],
        **_failover_summary(chaos["failovers"]),
        "lost_updates": chaos["lost_updates"],
        "duplicate_updates": chaos["duplicate_updates"],
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


def _failover_summary(failovers: list[dict[str, Any]]) -> dict[str, Any]:
    """The failovers' median and maximum (all kinds together, and the median of each kind); with a
    coordinator, the median of each kind's wait for the failed primary's lease to end, and of the
    failover past that end (what follows the lease: the takeover, the workers' move, the step);
    then the list of them."""
    seconds = [f["seconds"] for f in failovers]
    leased = [f for f in failovers if f.get("lease_s") is not None]
    return {
        "failover_p50_s": statistics.median(seconds) if seconds else None,
        "failover_max_s": max(seconds) if seconds else None,
        "failover_p50_by_kind_s": _median_by_kind(failovers, lambda f: f["seconds"]),
        "lease_end_p50_by_kind_s": _median_by_kind(leased, lambda f: f["lease_s"]),
        "past_lease_end_p50_by_kind_s": _median_by_kind(leased, lambda f: f["seconds"] - f["lease_s"]),
        "failovers_measured": len(seconds),
        "failovers": [{k: _rounded(v) for k, v in f.items()} for f in failovers],
    }


def _median_by_kind(failovers: list[dict[str, Any]], value: Any) -> dict[str, float]:
    by_kind: dict[str, list[float]] = {}
    for f in failovers:
        by_kind.setdefault(f["kind"], []).append(value(f))
    return {kind: statistics.median(v) for kind, v in sorted(by_kind.items())}


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


if __name__ == "__main__":
    main()
