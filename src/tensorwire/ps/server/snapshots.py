"""Pulls from a parameter server (PS_PULL), and the copies of the parameters they send from.

A pull waits for its mode's gate (ps/server/consistency.py), notes the slowest live clock it read at
(replicated: the staleness of the worker's next push depends on it), then sends from a copy of
the parameters at the current version (``published``): made by the first pull after an update,
under the parameters' lock taken shared, and shared by the pulls that follow. Pulls send from it
without holding the lock, so a slow reader never holds up a step; the copy is one memcpy per
version. A worker may pull in a codec (int8 or bf16 weights, say): the copy is encoded once per
version and codec (``encoded``), in at most ``MAX_PULL_CODECS`` codecs; the server keeps full
precision.

Copies that slow pulls still send from are retired, not freed, and an idle retired copy's buffers
make the next one. Every copy and encoding is counted in the budget (``snapshots``) before it is
allocated.

Readers outside the job (observers: ``ps.pull_parameters``, evaluation) never make the job's own
workers' pulls wait: what a worker's pull may wait for is room among the copies slow *workers*
still send from (at most ``MAX_SNAPSHOTS``), never for copies only observers hold, which are
bounded apart (observers reading at most ``MAX_OBSERVER_SNAPSHOTS`` copies at once: a further
observer pull waits, within its own wait, for one of them to finish). No wait is made while
holding the lock that makes copies (``_publishing``), and encodings are made outside it (once per
version and codec, shared: an observer's on a thread of its own, not the job's optimizer thread);
observers may add at most ``MAX_OBSERVER_CODECS`` codecs to a version, beside the workers'
``MAX_PULL_CODECS``, so they cannot take the codecs the workers pull in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tensorwire.compression.codecs import Codec, from_wire
from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.ps.budget import Budget
from tensorwire.ps.job import HeldShard, Job
from tensorwire.ps.server import replication
from tensorwire.ps.server.consistency import Consistency
from tensorwire.ps.server.gradients import Gradients, nbytes
from tensorwire.ps.server.membership import Members
from tensorwire.ps.server.replica import Replica
from tensorwire.server.core import Request
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.tensors import byte_view

MAX_SNAPSHOTS = 4  # older copies of the parameters that slow workers' pulls may still send from
MAX_OBSERVER_SNAPSHOTS = 2  # copies that readers outside the job (observers) may send from at once
MAX_PULL_CODECS = 4  # codecs one version of the parameters is kept encoded in for workers' pulls
MAX_OBSERVER_CODECS = 1  # codecs observers may add to one version beside the workers'


@dataclass(eq=False)
class Snapshot:
    """A copy of the parameters at one version, which pulls send from (see ``published``)."""

    generation: int  # of the job's shards (a restore makes new ones)
    version: int
    metas: dict[str, TensorMeta]
    tensors: dict[str, torch.Tensor]
    workers: int = 0  # workers' pulls sending from it right now
    observers: int = 0  # observers' pulls sending from it right now
    encoded: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # by codec: payloads
    encoding: dict[str, asyncio.Future[dict[str, torch.Tensor]]] = field(default_factory=dict)
    observer_codecs: set[str] = field(default_factory=set)  # codecs only observers asked for
    held: int = 0  # bytes of its tensors and encodings, counted in the server's budget

    @property
    def readers(self) -> int:
        """Pulls sending from it right now."""
        return self.workers + self.observers


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
        observer = head.worker == wps.OBSERVER
        with request.waiting():
            snapshot = await self._published(head, observer)
        _read(snapshot, observer, +1)
        try:
            metas = [snapshot.metas[name] for name in names]
            tensors = snapshot.tensors
            if codec is not None:  # the records describe the payloads (clients land data by records)
                with request.waiting():
                    tensors = await self._encoded(snapshot, codec, observer)
                metas = [TensorMeta(m.name, torch.uint8, (tensors[m.name].numel(),), tensors[m.name].numel(),
                                    m.version) for m in metas]  # fmt: skip
            data = [byte_view(tensors[name]) for name in names]
            tail = wps.encode_u64(snapshot.version) + wps.encode_codec(codec.name if codec else None)
            await request.reply(wm.encode_records(metas) + tail, data)
        finally:
            _read(snapshot, observer, -1)
            consistency.notify()

    async def admit(self, request: Request, head: wps.PsHead, names: Sequence[str] = ()) -> None:
        """What a pull (PS_PULL, or PS_RELAY: ps/server/relay.py) waits for before it reads: the job's
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

    async def _published(self, head: wps.PsHead, observer: bool) -> Snapshot:
        """A copy of the parameters at the current version, made by the first pull after a step and
        shared by the pulls that follow. Pulls send from it without holding the parameters' lock,
        so a slow reader never holds up a step; the copy is one memcpy per version. A pull that
        must wait for room (see the module doc) waits without holding the lock copies are made
        under, so nobody else's pull waits on it."""
        if self._publishing is None:
            self._publishing = asyncio.Lock()
        while True:
            async with self._publishing:
                if self._can_read(observer):
                    current = self._current
                    if current is not None and self._fresh(current):
                        return current
                    return await self._publish(current)
            what = f"one of {MAX_SNAPSHOTS} slow workers' pulls to finish"
            if observer:
                what = f"one of the {MAX_OBSERVER_SNAPSHOTS} copies observers read, or {what}"
            await self._consistency.wait(lambda: self._can_read(observer), head, what)

    def _fresh(self, snapshot: Snapshot) -> bool:
        """Whether ``snapshot`` holds the job's current values."""
        return snapshot.version == self._job.version and snapshot.generation == self._job.generation

    def _can_read(self, observer: bool) -> bool:
        """Whether a pull may read now: from the current copy, or from a new one it makes (room for
        it among the copies workers' pulls send from; an observer also needs room among the
        copies observers read)."""
        current = self._current
        fresh = current is not None and self._fresh(current)
        if observer and not self._observer_room(current if fresh else None):
            return False
        return fresh or self._worker_room()

    def _worker_room(self) -> bool:
        """Whether a new copy may be made: fewer than MAX_SNAPSHOTS retired copies have workers'
        pulls sending from them (copies only observers read do not count: they are bounded apart)."""
        return sum(s.workers > 0 for s in self._retired) < MAX_SNAPSHOTS

    def _observer_room(self, joining: Snapshot | None) -> bool:
        """Whether an observer may read ``joining``: observers read it already, or fewer than
        MAX_OBSERVER_SNAPSHOTS copies."""
        if joining is not None and joining.observers:
            return True
        held = [s for s in [*self._retired, *filter(None, [self._current])] if s.observers]
        return len(held) < MAX_OBSERVER_SNAPSHOTS

    async def _publish(self, current: Snapshot | None) -> Snapshot:
        """Make the copy of the current version (``_publishing`` held), retiring ``current``."""
        job = self._job
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

    async def _encoded(self, snapshot: Snapshot, codec: Codec, observer: bool) -> dict[str, torch.Tensor]:
        """The snapshot's shards in ``codec`` (a worker pulling int8 or bf16 weights), encoded once
        per version and codec and shared by the pulls that follow; the server keeps full precision.
        Made outside every lock (a slow encoding holds up no other pull): a worker's on the job's
        thread, an observer's on a thread of its own."""
        cached = snapshot.encoded.get(codec.name)
        if cached is not None:
            return cached
        pending = snapshot.encoding.get(codec.name)
        if pending is None:
            self._check_codec_room(snapshot, codec, observer)
            size = sum(codec.payload_bytes(t.numel()) for t in snapshot.tensors.values())
            self._gradients.make_room(size)
            self._budget.reserve("snapshots", size, f"the parameters encoded in {codec.name}")
            snapshot.held += size
            if observer:
                snapshot.observer_codecs.add(codec.name)
            pending = asyncio.ensure_future(self._encode(snapshot, codec, size, observer))
            snapshot.encoding[codec.name] = pending
        return await asyncio.shield(pending)

    @staticmethod
    def _check_codec_room(snapshot: Snapshot, codec: Codec, observer: bool) -> None:
        """Codec names are the peers' choice: a bounded number per version, workers' and
        observers' apart (LimitExceeded naming those kept)."""
        codecs = [*snapshot.encoded, *snapshot.encoding]
        mine = [c for c in codecs if (c in snapshot.observer_codecs) == observer]
        bound = MAX_OBSERVER_CODECS if observer else MAX_PULL_CODECS
        if len(mine) >= bound:
            who = "observers' pulls (readers outside the job)" if observer else "pulls"
            raise LimitExceeded(
                f"{who} of one version are kept in at most {bound} codecs ({', '.join(mine)}): pull in "
                f"one of those{' or in full precision' if observer else ''}"
            )

    async def _encode(
        self, snapshot: Snapshot, codec: Codec, size: int, observer: bool
    ) -> dict[str, torch.Tensor]:
        try:
            if observer:
                encoded = await asyncio.to_thread(_encode_all, codec, snapshot.tensors)
            else:
                encoded = await self._job.run(_encode_all, codec, snapshot.tensors)
        except BaseException:
            snapshot.encoding.pop(codec.name, None)
            snapshot.observer_codecs.discard(codec.name)
            snapshot.held -= size
            self._budget.release("snapshots", size)
            raise
        snapshot.encoded[codec.name] = encoded
        snapshot.encoding.pop(codec.name, None)
        return encoded

    def _drop_encodings(self, snapshot: Snapshot) -> None:
        size = sum(map(nbytes, (list(e.values()) for e in snapshot.encoded.values())))
        snapshot.encoded = {}
        snapshot.observer_codecs.clear()
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


def _read(snapshot: Snapshot, observer: bool, change: int) -> None:
    """A pull starts (+1) or stops (-1) sending from ``snapshot``."""
    if observer:
        snapshot.observers += change
    else:
        snapshot.workers += change


def _encode_all(codec: Codec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: codec.encode(tensor) for key, tensor in tensors.items()}


def _copy_shards(snapshot: Snapshot, shards: Mapping[str, HeldShard]) -> None:
    for key, shard in shards.items():
        snapshot.tensors[key].copy_(shard.param.data)
