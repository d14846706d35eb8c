"""The server side of pulls through the relay (``ps.Worker(pull="relay")``): PS_RELAY.

A worker that pulls through the relay sends PS_RELAY where it would send PS_PULL. The server waits
for the pull's gate exactly as for PS_PULL (snapshots.py ``Snapshots.admit``), then makes sure the
job's current parameters are published as a generation of ``_ps/<job>`` in the server's own
generation store (store/generations.py; the ``SERVER_PREFIX`` no client may publish under), and
answers the version and the generation's number. The worker then reads that generation through the
relay like any ``Subscriber`` (RELAY_JOIN / RELAY_GET / RELAY_REPORT, broadcast/coordinator.py,
which every server with a ``ParamServer`` serves): the server strings the job's workers into
chains and its link carries each version about once, whatever the number of workers.

One copy of the parameters per version: made by the first PS_RELAY after an update (under the
parameters' lock taken shared, in the job's thread, with its chunk checksums), shared by the
PS_RELAYs that follow. It is a reservation of the server's store, so it counts against the
server's capacity (CapacityExceeded when it does not fit: the worker pulls directly instead), and
the store keeps the last ``--keep-generations`` of them (2 by default); a job that ended has its
generations dropped at the next publish.

Who relays: the PS_RELAY of a live worker (its session checked, as for a pull) admits that
session, the worker process's incarnation, to register in the job's chains (``admit``); the worker's
RELAY_JOIN names it, over the worker's own tcp:// or tls:// connection, whose address the relay
address is checked against (ps/worker/relay_reader.py: not the slot's connection, which may be shm://).
An observer's PS_RELAY admits nothing, and a RELAY_JOIN naming no admitted session reads from the
server, unregistered (broadcast/coordinator.py): readers outside the job are never upstream of its
workers, so they cannot make the workers' pulls wait. A job that ended has its admissions dropped.

Lifecycle: the ``ParamServer`` makes one ``RelayPublisher``; when the ``ParamServer`` is added to a
server (``added_to``) it ``attach``es the server's generations and relay tables, after which
``publish`` may be called from the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorwire.broadcast.chains import Chains
from tensorwire.errors import ProtocolError
from tensorwire.ps.job import HeldShard, Job, relay_name, relay_prefix
from tensorwire.store.generations import Generations
from tensorwire.store.memory import Reservation
from tensorwire.types import TensorMeta
from tensorwire.wire import generations as wg


@dataclass(frozen=True, slots=True)
class Published:
    """The last version of one job published for relay pulls."""

    shards: int  # the job's shards generation (a restore or re-init makes new ones)
    version: int
    number: int  # the generation's number in the store


class RelayPublisher:
    """Publishes jobs' parameters as generations for relay pulls (see the module doc)."""

    def __init__(self) -> None:
        self.generations: Generations | None = None
        self.chains: Chains | None = None  # the relay's tables: what it served, per prefix
        self.published = 0  # versions published (copies made)
        self.published_bytes = 0
        self._last: dict[str, Published] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def attach(self, generations: Generations, chains: Chains) -> None:
        self.generations, self.chains = generations, chains

    def admit(self, job: str, session: int) -> None:
        """A PS_RELAY came from ``session``, a live worker of ``job``: it may register in the job's
        chains (see the module doc). Call it only once the worker's session is checked."""
        if self.chains is not None and session:
            self.chains.admit(relay_prefix(job), session)

    async def publish(self, job: Job, held: Callable[[str], bool]) -> tuple[int, int]:
        """The job's current parameters as a generation: (version, generation number). ``held``
        says whether a job id is still held here (the generations of those that are not go)."""
        generations = self.generations
        if generations is None:
            raise ProtocolError("this parameter server has no generation store: it cannot relay pulls")
        lock = self._locks.setdefault(job.id, asyncio.Lock())
        async with lock:
            last = self._last.get(job.id)
            if last is not None and (last.shards, last.version) == (job.generation, job.version):
                return last.version, last.number
            self._forget_ended(generations, held)
            last = await self._publish(generations, job)
            self._last[job.id] = last
            return last.version, last.number

    async def _publish(self, generations: Generations, job: Job) -> Published:
        prefix = relay_prefix(job.id)
        generations.admit(prefix, internal=True)  # before a byte is reserved
        shards = dict(job.shards)
        metas = [_meta(relay_name(job.id, key), shard.meta) for key, shard in shards.items()]
        res = generations.store.reserve(metas)  # CapacityExceeded: nothing kept
        try:
            async with job.lock.shared():  # no step while the values are copied
                version, generation = job.version, job.generation
                await job.run(_copy_into, res, list(shards.values()))
            sums = await job.run(_checksums, res.buffers)
        except BaseException:
            generations.store.abort(res)
            raise
        gen = generations.publish(prefix, res, sums, internal=True)
        self.published += 1
        self.published_bytes += res.nbytes
        return Published(generation, version, gen.number)

    def _forget_ended(self, generations: Generations, held: Callable[[str], bool]) -> None:
        for job_id in [j for j in self._last if not held(j)]:
            del self._last[job_id]
            self._locks.pop(job_id, None)
            generations.forget(relay_prefix(job_id))
            if self.chains is not None:
                self.chains.forget(relay_prefix(job_id))

    def stats(self) -> dict[str, Any]:
        """PS_STATS' ``relay``: versions published, their bytes, and the bytes the relay served
        from this server per job (RELAY_GET answers; what its link carried for relay pulls)."""
        totals = self.chains.totals() if self.chains is not None else {}
        root = relay_prefix("")
        served = {p[len(root) :]: n for p, n in totals.items() if p.startswith(root)}
        return {"published": self.published, "published_bytes": self.published_bytes, "served_bytes": served}


def _meta(name: str, meta: TensorMeta) -> TensorMeta:
    return TensorMeta(name, meta.dtype, meta.shape, meta.nbytes)


def _copy_into(res: Reservation, shards: Sequence[HeldShard]) -> None:
    for buffer, shard in zip(res.buffers, shards, strict=True):
        if len(buffer):
            flat = shard.param.data.reshape(-1).view(torch.uint8)
            torch.frombuffer(buffer, dtype=torch.uint8).copy_(flat)


def _checksums(buffers: Sequence[memoryview]) -> list[tuple[int, ...]]:
    return [wg.chunk_checksums(buffer) for buffer in buffers]
