"""Parameter servers (and plain stores) as Ray actors, spread over the nodes by a placement group.

``start_servers(num=S, replicas=R)`` reserves one bundle per server process (S x (1 + R)), with
the SPREAD strategy (best effort: different nodes while there are nodes), starts one
``ServerActor`` in each, then all the servers at once, the replicas of a slot sharing a fresh
peer token (``ps.launch.role_flags``: a slot's first replica is its primary, the others its
standbys). A slot whose primary shares a node with a backup (a cluster with fewer nodes than
replicas) is logged as a warning and listed in ``Servers.colocated``: one node's failure takes both.
"""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tensorwire.errors import ClusterError
from tensorwire.ps.launch import role_flags
from tensorwire.ray import cluster
from tensorwire.ray.actor import ServerActor

log = logging.getLogger(__name__)

START_TIMEOUT = 120.0  # seconds for the resources, the actors and the servers, each
STOP_GRACE = 5.0  # seconds a server gets to exit after SIGTERM before SIGKILL
_Actor = ray.remote(max_restarts=0)(ServerActor)  # a restarted actor would be an empty server
# A task on a dead actor's node removes what it left; only shutil to import, so it starts fast.
_sweep = ray.remote(num_cpus=0, max_retries=0)(shutil.rmtree)


@dataclass(frozen=True)
class Replica:
    """One server process: replica ``index`` of slot ``slot`` (0: the primary)."""

    slot: int
    index: int
    url: str
    node: str  # the Ray node id it runs on
    pid: int  # the server process's, on that node
    actor: Any  # its ray.actor.ActorHandle: ``ray.kill(replica.actor)`` kills the server too
    workdir: str


@dataclass
class Servers:
    """Servers on a Ray cluster; ``stop()`` (or leaving the ``with`` block) ends them all."""

    slots: list[list[Replica]]
    placement: PlacementGroup
    colocated: list[int] = field(default_factory=list)  # slots with a backup on the primary's node
    token: str | None = field(default=None, repr=False)  # the clients' (``TENSORWIRE_TOKEN``), if any
    _stopped: bool = field(default=False, init=False, repr=False)

    @property
    def urls(self) -> list[str]:
        """One address per slot, its replicas joined by ``|``, the primary first."""
        return ["|".join(r.url for r in slot) for slot in self.slots]

    @property
    def address(self) -> str:
        """The value of ``TENSORWIRE_SERVERS`` (``ps.Worker``'s ``servers``): the slots joined by ``,``."""
        return ",".join(self.urls)

    @property
    def replicas(self) -> list[Replica]:
        return [r for slot in self.slots for r in slot]

    def output(self, replica: Replica, timeout: float = 30.0) -> str:
        """What a live server printed (its log)."""
        return str(ray.get(replica.actor.output.remote(), timeout=timeout))

    def stop(self, grace: float = STOP_GRACE) -> None:
        """End every server (SIGTERM, then SIGKILL after ``grace`` s) and its actor, remove what a
        killed actor left on its node, and give the placement group back. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            _stop(self.replicas, grace)
        finally:
            cluster.release(self.placement)

    def __enter__(self) -> Servers:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_servers(
    num: int,
    replicas: int = 0,
    *,
    extra_args: Sequence[str] = (),
    capacity: str = "8GiB",
    token: str | None = None,
    keep_jobs: bool = True,
    cpus: float = 1.0,
    host: str | None = None,
    timeout: float = START_TIMEOUT,
) -> Servers:
    """``num`` parameter-server slots on the Ray cluster this process is connected to
    (``ray.init``), each a primary and ``replicas`` standbys: ``tensorwire ps serve`` processes, one
    per actor, ``cpus`` CPUs reserved for each. ``extra_args``: more ``serve`` flags for every
    server (``--failover-timeout 1``); ``token``: the clients' token the servers require;
    ``keep_jobs``: a job outlives its workers (``--keep-jobs``), so the driver can read the trained
    parameters (``ps.pull_parameters(model, servers.address)``). ``host``: the address to serve
    on (default each node's Ray address). Raises ``ClusterError`` (``ClusterTimeout`` after
    ``timeout`` s of any phase) naming what failed; nothing started is left running then."""
    flags = (*(["--keep-jobs"] if keep_jobs else []), *extra_args)
    return _start(num, replicas, _Spec(flags, capacity, token, cpus, host, timeout))


def start_stores(
    num: int,
    *,
    extra_args: Sequence[str] = (),
    capacity: str = "8GiB",
    token: str | None = None,
    cpus: float = 1.0,
    host: str | None = None,
    timeout: float = START_TIMEOUT,
) -> Servers:
    """``num`` plain tensor stores (``tensorwire serve``), spread like ``start_servers``'s; one
    per node on a cluster of ``num`` nodes or more. ``servers.urls`` are their addresses."""
    return _start(num, 0, _Spec(tuple(extra_args), capacity, token, cpus, host, timeout))


@dataclass(frozen=True)
class _Spec:
    """What every server of one ``start_*`` call gets (see ``start_servers``)."""

    flags: tuple[str, ...]
    capacity: str
    token: str | None
    cpus: float
    host: str | None
    timeout: float


def _start(num: int, replicas: int, spec: _Spec) -> Servers:
    if num < 1 or replicas < 0:
        raise ValueError(f"need num >= 1 and replicas >= 0, not num={num}, replicas={replicas}")
    size = replicas + 1
    what = f"{num} server slots x {size} replicas"
    group = cluster.reserve([{"CPU": spec.cpus}] * (num * size), "SPREAD", spec.timeout, what)
    actors: list[Any] = []
    try:
        nodes = cluster.bundle_nodes(group)
        for bundle in range(num * size):
            place = cluster.in_bundle(group, bundle)
            actors.append(_Actor.options(num_cpus=spec.cpus, scheduling_strategy=place).remote(spec.host))
        names = [_name(*divmod(b, size)) for b in range(num * size)]
        where = cluster.gather(
            [a.address.remote() for a in actors], names, spec.timeout, f"the actors of {what}"
        )
        started = _start_replicas(actors, [url for url, _ in where], size, spec)
    except BaseException:
        _abandon(actors)
        cluster.release(group)
        raise
    slots = [
        [Replica(b // size, b % size, started[b][0], nodes[b], started[b][1], actors[b], where[b][1])
         for b in range(s * size, (s + 1) * size)]
        for s in range(num)
    ]  # fmt: skip
    return Servers(slots, group, _colocated(slots), spec.token)


def _start_replicas(
    actors: Sequence[Any], listen: Sequence[str], size: int, spec: _Spec
) -> list[tuple[str, int]]:
    """Start every server at once; each one's (url, pid), in bundle order. The order does not
    matter: a standby takes over only from a primary it has heard from, and a primary first sends
    to its backups when a worker changes something, after every replica is listening."""
    peers = [secrets.token_urlsafe(32) for _ in range(len(actors) // size)]  # one per slot
    refs = []
    for bundle, actor in enumerate(actors):
        slot, index = divmod(bundle, size)
        flags = list(spec.flags)
        secret = {"--token-file": spec.token} if spec.token else {}
        if size > 1:
            flags = [*role_flags(listen[slot * size : (slot + 1) * size], index), *flags]
            secret["--peer-token-file"] = peers[slot]
        refs.append(actor.start.remote(spec.capacity, flags, secret, spec.timeout))
    names = [_name(*divmod(b, size)) for b in range(len(actors))]
    # The actor's own deadline comes first, so its error (with the server's output) is the one seen.
    return [(url, pid) for url, pid in cluster.gather(refs, names, spec.timeout + 30, "the servers to start")]


def _stop(replicas: Sequence[Replica], grace: float) -> None:
    """Stop every server through its actor, then kill the actors; sweep the working directory of
    each actor that was dead already (killed by a test, or its server never stopped in time)."""
    refs = [r.actor.stop.remote(grace) for r in replicas]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=grace + 30)
    dead = [r for r, ref in zip(replicas, refs, strict=True) if not _stopped(ref, done, r)]
    for replica in replicas:
        ray.kill(replica.actor)
    on_node = [NodeAffinitySchedulingStrategy(r.node, soft=False) for r in dead]
    # True: rmtree's ignore_errors (Ray's stubs give shutil.rmtree no arguments).
    sweeps = [
        _sweep.options(scheduling_strategy=n).remote(r.workdir, True)  # type: ignore[call-arg]
        for n, r in zip(on_node, dead, strict=True)
    ]
    try:
        cluster.gather(
            sweeps, [_name(r.slot, r.index) for r in dead], grace + 30, "the sweeps of dead actors"
        )
    except ClusterError as exc:  # files left in a temporary directory: worth a line, not a failure
        log.warning("could not remove what a killed server actor left: %s", exc)


def _abandon(actors: Sequence[Any]) -> None:
    """End the actors of a start that failed: each stops its server (if any) and removes its
    working directory, within ``STOP_GRACE``; then every actor is killed."""
    if actors:
        ray.wait(
            [a.stop.remote(STOP_GRACE) for a in actors], num_returns=len(actors), timeout=STOP_GRACE + 10
        )
    for actor in actors:
        ray.kill(actor)


def _stopped(ref: Any, done: Sequence[Any], replica: Replica) -> bool:
    """Whether the actor's ``stop`` ran (else the actor was dead or hung, and left its files)."""
    if ref not in done:
        return False
    try:
        cluster.result(ref, _name(replica.slot, replica.index))
    except ClusterError:
        return False
    return True


def _colocated(slots: Sequence[Sequence[Replica]]) -> list[int]:
    """The slots whose primary shares a node with one of its backups, each logged as a warning."""
    shared = []
    for number, (primary, *backups) in enumerate(slots):
        if any(b.node == primary.node for b in backups):
            log.warning(
                "slot %d: its primary and a backup run on one node (%s): that node's failure takes "
                "both; the cluster has too few nodes for the SPREAD placement to keep them apart",
                number, primary.node[:12],
            )  # fmt: skip
            shared.append(number)
    return shared


def _name(slot: int, index: int) -> str:
    return f"slot {slot} " + ("primary" if index == 0 else f"backup {index}")
