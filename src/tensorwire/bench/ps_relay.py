"""Relay pulls in ``tensorwire bench ps``: what the servers' links carry per version, and the step
time, with ``pull="relay"`` against ``pull="direct"``.

The workload (``ps_baselines.Workload``) trained in ``sync`` mode twice on the same fresh servers,
one pull mode after the other (two jobs). The servers' egress for pulls per version: direct, what
the workers pulled (each version once per worker); relay, what each server's relay served
(PS_STATS ``relay.served_bytes``, RELAY_GET answers) plus what workers pulled directly after a
fallback. Fields:

* ``direct_server_egress_ratio``, ``relay_server_egress_ratio``: those bytes per version over the
  model's parameter bytes (direct: about the number of workers; relay: about 1);
* ``relay_vs_direct_step_time``: the relay run's step time over the direct run's;
* ``relay_fallbacks``: pulls that fell back to a direct pull (0 in a healthy run).
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import Any

import torch

from tensorwire.bench import ps_baselines as base
from tensorwire.ps import SGD, Worker
from tensorwire.ps.launch import local_servers
from tensorwire.ps.worker.rpc import server_stats


def train(
    w: base.Workload, rank: int, urls: list[str], mode: str, timeout: float, *, pull: str = "direct"
) -> tuple[float, int, int]:
    """Train one worker through the servers: (the seconds its timed steps took, the bytes it
    pulled directly, its relay fallbacks)."""
    torch.set_num_threads(1)
    model = base.make_model(w)
    batches = base._batches(w, rank)
    with Worker(model, urls, mode, SGD(lr=w.lr), rank=rank, world_size=w.workers, timeout=timeout,
                pull=pull, job=f"bench-{mode}-{pull}") as worker:  # fmt: skip
        for x, y in batches[: w.warmup]:
            base._backward(model, x, y)
            worker.step()
        start = time.perf_counter()
        for x, y in batches[w.warmup :]:
            base._backward(model, x, y)
            worker.step()
        elapsed = time.perf_counter() - start
        relay = worker.relay
        direct = worker.bytes_pulled - (relay.received if relay else 0)
        return elapsed, direct, relay.fallbacks if relay else 0


def _run(what: str, jobs: list[base.Job], timeout: float, children: bool) -> list[Any]:
    if children:
        return base.run_children(what, jobs, timeout)
    with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="bench") as pool:
        futures = [pool.submit(target, *args) for _, target, args in jobs]
        return [future.result(timeout) for future in futures]


def measure(
    w: base.Workload, servers: int, timeout: float, *, children: bool = True
) -> dict[str, float | int]:
    """Both runs on ``servers`` fresh servers (see the module doc); the workers are child processes
    (``children=False``: threads of this process, for a quick smoke test)."""
    param_bytes = base.param_count(w) * 4  # float32
    versions = w.warmup + w.steps + 1  # the first pull, then one per step
    runs: dict[str, list[Any]] = {}
    with local_servers(servers) as urls:
        for pull in ("direct", "relay"):
            worker = functools.partial(train, pull=pull)
            args = [(w, rank, urls, "sync", timeout) for rank in range(w.workers)]
            jobs: list[base.Job] = [(f"ps {pull} worker {a[1]}", worker, a) for a in args]
            runs[pull] = _run(f"tensorwire {pull}-pull workers", jobs, timeout, children)
        served = sum(s["relay"]["served_bytes"].get("bench-sync-relay", 0) for s in server_stats(urls))
    direct_egress = sum(r[1] for r in runs["direct"])
    relay_egress = served + sum(r[1] for r in runs["relay"])
    step = {pull: max(r[0] for r in results) for pull, results in runs.items()}
    return {
        "direct_server_egress_ratio": direct_egress / (versions * param_bytes),
        "relay_server_egress_ratio": relay_egress / (versions * param_bytes),
        "relay_vs_direct_step_time": step["relay"] / step["direct"],
        "relay_fallbacks": sum(r[2] for r in runs["relay"]),
    }
