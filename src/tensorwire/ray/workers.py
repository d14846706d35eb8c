"""Training functions as Ray tasks, one per rank, with the variables torchrun would set.

``run_workers(fn, num=W, servers=servers)`` reserves W bundles in one placement group (so every
rank runs at once: a synchronous job whose ranks ran in turns would wait for itself), then runs
``fn(*args)`` once per bundle as a Ray task whose environment holds ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (the ranks on the same node, from where the bundles
landed), ``TENSORWIRE_SERVERS`` (and ``TENSORWIRE_TOKEN`` when the servers require one), which
``ps.Worker`` reads. It returns what each rank returned, in rank order; the first rank that fails
ends the others and raises ``ClusterError`` naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import ray

from tensorwire.ps.rendezvous import SERVERS_ENV
from tensorwire.ray import cluster
from tensorwire.ray.servers import Servers
from tensorwire.security import TOKEN_ENV

T = TypeVar("T")
RUN_TIMEOUT = 3600.0  # seconds for the resources, then again for the training itself


def _call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    return fn(*args, **kwargs)


# A rank that failed is not run again behind the others' backs: the caller decides.
_rank = ray.remote(max_retries=0)(_call)


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
    refs: list[Any] = []
    try:
        nodes = cluster.bundle_nodes(group)
        base = {**(env or {}), **_server_env(servers)}
        for rank in range(num):
            variables = {**base, **_rank_env(rank, nodes)}
            refs.append(
                _rank.options(
                    num_cpus=cpus, num_gpus=gpus, scheduling_strategy=cluster.in_bundle(group, rank),
                    runtime_env={"env_vars": variables},
                ).remote(fn, args, kwargs or {})
            )  # fmt: skip
        names = [f"worker rank {rank} of {num}" for rank in range(num)]
        what = f"{num} workers running {getattr(fn, '__qualname__', fn)!s}"
        return cluster.gather(refs, names, timeout, what)
    finally:
        for ref in refs:  # those still running, after a failure or a timeout
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
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
