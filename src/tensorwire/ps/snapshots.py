"""Pulls from a parameter server (PS_PULL), and the copies of the parameters they send from.

A pull waits for its mode's gate (ps/consistency.py), notes the slowest live clock it read at
(replicated: the staleness of the worker's next push depends on it), then sends from a copy of
the parameters at the current version (``published``): made by the first pull after an update,
under the parameters' lock taken shared, and shared by the pulls that follow. Pulls send from it
without holding the lock, so a slow reader never holds up a step; the copy is one memcpy per
version. A worker may pull in a codec (int8 or bf16 weights, say): the copy is encoded once per
version and codec (``encoded``), in at most ``MAX_PULL_CODECS`` codecs; the server keeps full
precision.

Copies that slow pulls still send from are retired, not freed; at most ``MAX_SNAPSHOTS`` of them
are kept (a pull waits for room), and an idle retired copy's buffers make the next one. Every copy
and encoding is counted in the budget (``snapshots``) before it is allocated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tensorwire.compression import Codec, from_wire
from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.ps import replication
from tensorwire.ps.budget import Budget
from tensorwire.ps.consistency import Consistency
from tensorwire.ps.gradients import Gradients, nbytes
from tensorwire.ps.job import HeldShard, Job
from tensorwire.ps.membership import Members
from tensorwire.ps.replica import Replica
from tensorwire.server.core import Request
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.tensors import byte_view

MAX_SNAPSHOTS = 4  # older copies of the parameters that slow pulls may still be sending from
MAX_PULL_CODECS = 4  # codecs one version of the parameters is kept encoded in for pulls


@dataclass(eq=False)
class Snapshot:
    """A copy of the parameters at one version, which pulls send from (see ``published``)."""

    generation: int  # of the job's shards (a restore makes new ones)
    version: int
    metas: dict[str, TensorMeta]
    tensors: dict[str, torch.Tensor]
    readers: int = 0  # pulls sending from it right now
    encoded: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # by codec: payloads
    held: int = 0  # bytes of its tensors and encodings, counted in the server's budget


class Snapshots:
    """PS_PULL and the copies it sends from (see the module doc)."""

    def __init__(
        self,
        job: Job,
        budget: Budget,
        gradients: Gradients,
        *,
        members: Members,
        consistency: Consistency,
        replica: Replica,
    ) -> None:
        self._job = job
        self._budget = budget
        self._gradients = gradients
        self._members = members
        self._consistency = consistency
        self._replica = replica
        self._current: Snapshot | None = None  # the copy pulls send from
        self._retired: list[Snapshot] = []
        self._publishing: asyncio.Lock | None = None

    def close(self) -> None:
        """The job ended: its copies go (a pull still sending keeps its own reference; the job's
        budget is cleared as a whole)."""
        self._current = None
        self._retired = []

    @property
    def sending(self) -> int:
        """Pulls sending right now."""
        return sum(s.readers for s in [*self._retired, *filter(None, [self._current])])

    async def on_pull(self, request: Request, head: wps.PsHead) -> None:
        """PS_PULL of this job (the server checked this replica serves and decoded the head)."""
        names = wm.decode_names(request.meta)
        codec = from_wire(wps.decode_codec(request.meta))
        request.meta.done()
        if codec is not None and codec.sparse:
            raise ProtocolError(f"{codec.name} drops elements: parameters cannot be pulled in it")
        await self.admit(request, head, names)
        consistency = self._consistency
        with request.waiting():
            snapshot = await self._published(head)
        snapshot.readers += 1
        try:
            metas = [snapshot.metas[name] for name in names]
            tensors = snapshot.tensors
            if codec is not None:  # the records describe the payloads (clients land data by records)
                tensors = await self._encoded(snapshot, codec)
                metas = [TensorMeta(m.name, torch.uint8, (tensors[m.name].numel(),), tensors[m.name].numel(),
                                    m.version) for m in metas]  # fmt: skip
            data = [byte_view(tensors[name]) for name in names]
            tail = wps.encode_u64(snapshot.version) + wps.encode_codec(codec.name if codec else None)
            await request.reply(wm.encode_records(metas) + tail, data)
        finally:
            snapshot.readers -= 1
            consistency.notify()

    async def admit(self, request: Request, head: wps.PsHead, names: Sequence[str] = ()) -> None:
        """What a pull (PS_PULL, or PS_RELAY: ps/relay.py) waits for before it reads: the job's
        values, then the mode's gate; the slowest live clock it reads at is noted (replicated)."""
        job, consistency = self._job, self._consistency
        with request.waiting():
            await consistency.wait(
                lambda: job.config is not None, head, "the job's parameters to be initialised"
            )
        for name in names:
            job.shard(name)  # ProtocolError for a shard this server does not hold
        if len(set(names)) != len(names):
            raise ProtocolError("PS_PULL names the same shard twice")
        state = self._members.member(request, head, head.seq) if head.worker != wps.OBSERVER else None
        if state is not None:
            with request.waiting():
                await consistency.gate(head, state)
            read = self._members.slowest() if job.mode and job.mode.kind != "sync" else head.clock
            if read != state.read_clock:
                async with self._replica.in_order():
                    consistency.check_open()
                    await self._replica.replicate(replication.Change.READ, head._replace(clock=read))
                    state.read_clock = read
        consistency.check_open()

    async def _published(self, head: wps.PsHead) -> Snapshot:
        """A copy of the parameters at the current version, made by the first pull after a step and
        shared by the pulls that follow. Pulls send from it without holding the parameters' lock,
        so a slow reader never holds up a step; the copy is one memcpy per version."""
        if self._publishing is None:
            self._publishing = asyncio.Lock()
        job = self._job
        async with self._publishing:
            current = self._current
            if (
                current is not None
                and current.version == job.version
                and current.generation == job.generation
            ):
                return current
            room = lambda: sum(s.readers > 0 for s in self._retired) < MAX_SNAPSHOTS  # noqa: E731
            await self._consistency.wait(room, head, f"one of {MAX_SNAPSHOTS} slow pulls to finish")
            async with job.lock.shared():  # no step while the values are copied
                fresh = self._spare()
                await job.run(_copy_shards, fresh, job.shards)
                fresh.version = job.version
                fresh.metas = {key: shard.meta for key, shard in job.shards.items()}
                self._drop_encodings(fresh)
            if current is not None:
                self._retired.append(current)
            self._current = fresh
            return fresh

    async def _encoded(self, snapshot: Snapshot, codec: Codec) -> dict[str, torch.Tensor]:
        """The snapshot's shards in ``codec`` (a worker pulling int8 or bf16 weights), encoded once
        per version and codec and shared by the pulls that follow; the server keeps full precision."""
        cached = snapshot.encoded.get(codec.name)
        if cached is None:
            assert self._publishing is not None  # made by the _published call before this one
            async with self._publishing:
                cached = snapshot.encoded.get(codec.name)
                if cached is None:
                    # Codec names are the peers' choice: a bounded number per version, each counted.
                    if len(snapshot.encoded) >= MAX_PULL_CODECS:
                        raise LimitExceeded(
                            f"pulls of one version are kept in at most {MAX_PULL_CODECS} codecs "
                            f"({', '.join(snapshot.encoded)}): pull in one of those"
                        )
                    size = sum(codec.payload_bytes(t.numel()) for t in snapshot.tensors.values())
                    self._gradients.make_room(size)
                    self._budget.reserve("snapshots", size, f"the parameters encoded in {codec.name}")
                    snapshot.held += size
                    cached = await self._job.run(_encode_all, codec, snapshot.tensors)
                    snapshot.encoded[codec.name] = cached
        return cached

    def _drop_encodings(self, snapshot: Snapshot) -> None:
        size = sum(map(nbytes, (list(e.values()) for e in snapshot.encoded.values())))
        snapshot.encoded = {}
        snapshot.held -= size
        self._budget.release("snapshots", size)

    def _spare(self) -> Snapshot:
        """A retired copy nobody is sending from any more (its buffers are reused: fresh pages
        cost more than the copy), or a new one."""
        generation, shards = self._job.generation, self._job.shards
        idle = [s for s in self._retired if s.readers == 0 and s.generation == generation]
        for gone in [s for s in self._retired if s.readers == 0 and s is not (idle[0] if idle else None)]:
            self._budget.release("snapshots", gone.held)
        self._retired = [s for s in self._retired if s.readers > 0]
        if idle:
            return idle[0]
        size = sum(shard.meta.nbytes for shard in shards.values())
        self._gradients.make_room(size)
        self._budget.reserve("snapshots", size, "a copy of the parameters for pulls")
        tensors = {key: torch.empty_like(shard.param.data) for key, shard in shards.items()}
        return Snapshot(generation, -1, {}, tensors, held=size)


def _encode_all(codec: Codec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: codec.encode(tensor) for key, tensor in tensors.items()}


def _copy_shards(snapshot: Snapshot, shards: Mapping[str, HeldShard]) -> None:
    for key, shard in shards.items():
        snapshot.tensors[key].copy_(shard.param.data)
