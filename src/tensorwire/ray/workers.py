"""Training functions on Ray, one actor per rank, with the variables torchrun would set.

``run_workers(fn, num=W, servers=servers)`` reserves W bundles in one placement group (so every
rank runs at once: a synchronous job whose ranks ran in turns would wait for itself), then runs
``fn(*args)`` once per bundle in a Ray actor whose environment holds ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (the ranks on the same node, from where the bundles
landed), ``TENSORWIRE_SERVERS`` (and ``TENSORWIRE_TOKEN`` when the servers require one), which
``ps.Worker`` reads. It returns what each rank returned, in rank order; the first rank that fails
ends the others and raises ``ClusterError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import ray

from tensorwire.ps.worker.rendezvous import SERVERS_ENV
from tensorwire.ray import cluster
from tensorwire.ray.servers import Servers
from tensorwire.security import TOKEN_ENV

T = TypeVar("T")
RUN_TIMEOUT = 3600.0  # seconds for the resources, then again for the training itself


class _Rank:
    """One rank: an actor (a process of its own, with the rank's environment) that runs ``fn``.
    An actor rather than a task: ``ray.kill`` ends the others when one fails, where cancelling a
    task that is finishing at that moment can abort the driver (Ray 2.60)."""

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        return fn(*args, **kwargs)


# A rank that failed is not run again behind the others' backs: the caller decides.
_Actor = ray.remote(max_restarts=0, max_task_retries=0)(_Rank)


def run_workers(
    fn: Callable[..., T],
    num: int,
    servers: Servers | str | Sequence[str] | None = None,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    cpus: float = 1.0,
    gpus: float = 0.0,
    strategy: str = "PACK",
    timeout: float = RUN_TIMEOUT,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` as ``num`` ranks (see the module doc); ``env``: more variables
    for every rank; ``cpus``/``gpus``: what each rank reserves; ``strategy``: the placement
    group's (PACK: as few nodes as fit, SPREAD: as many). ``ClusterTimeout`` names what did not
    come within ``timeout`` s (the resources, or the ranks still running); nothing is left running."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    group = cluster.reserve([bundle] * num, strategy, timeout, f"{num} workers")
    ranks: list[Any] = []
    try:
        nodes = cluster.bundle_nodes(group)
        base = {**(env or {}), **_server_env(servers)}
        for rank in range(num):
            variables = {**base, **_rank_env(rank, nodes)}
            ranks.append(
                _Actor.options(
                    num_cpus=cpus, num_gpus=gpus, scheduling_strategy=cluster.in_bundle(group, rank),
                    runtime_env={"env_vars": variables},
                ).remote()
            )  # fmt: skip
        refs = [actor.run.remote(fn, args, kwargs or {}) for actor in ranks]
        names = [f"worker rank {rank} of {num}" for rank in range(num)]
        what = f"{num} workers running {getattr(fn, '__qualname__', fn)!s}"
        return cluster.gather(refs, names, timeout, what)
    finally:  # every rank's process ends, those still running after a failure or a timeout too
        for actor in ranks:
            ray.kill(actor)
        cluster.release(group)


def _server_env(servers: Servers | str | Sequence[str] | None) -> dict[str, str]:
    if servers is None:
        return {}
    if isinstance(servers, Servers):
        token = {TOKEN_ENV: servers.token} if servers.token else {}
        return {SERVERS_ENV: servers.address, **token}
    return {SERVERS_ENV: servers if isinstance(servers, str) else ",".join(servers)}


def _rank_env(rank: int, nodes: Sequence[str]) -> dict[str, str]:
    """torchrun's variables for ``rank``, whose bundle is on ``nodes[rank]``."""
    here = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(nodes)),
        "LOCAL_RANK": str(here.index(rank)),
        "LOCAL_WORLD_SIZE": str(len(here)),
    }
