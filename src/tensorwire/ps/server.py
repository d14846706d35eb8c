"""The server side of the parameter server: shards, their optimizer, and the consistency modes.

A ``ParamServer`` is an extension of a tensorwire ``Server`` (``Server(extensions=[ParamServer()])``,
which ``tensorwire ps serve`` does). It holds the shards that workers placed on it (``PS_INIT``),
each as an ``nn.Parameter`` over a flat range of elements, with one ``torch.optim`` optimizer over
all of them, and applies pushed gradients under one of three modes:

* ``sync``: the gradients of every live worker for clock t are averaged (summed in worker order,
  so a run is bit-reproducible), then the optimizer steps once; a pull for clock t+1 waits for
  that step. No step is taken before ``world`` workers have joined.
* ``async``: each push is applied as it arrives.
* ``ssp:s`` (stale synchronous parallel): pushes are applied as they arrive, and a worker pulling
  at clock c waits while c - (slowest live worker's clock) > s.

Staleness: when a worker pulls, the server notes the slowest live clock at that moment; the
staleness of its next push is its clock minus that note, i.e. how many clocks the gradient's
parameters may lag behind the updates of the slowest worker. ``sync`` always records 0, ``ssp:s``
never more than s (its pull gate is what guarantees it), ``async`` whatever happens.

Every wait (a pull for a step, a gate, initialisation) is bounded by the request's ``wait_ms`` or
the server's ``wait_timeout``, and ends in a TIMEOUT error that names what was waited for and who.

Who may act as a rank: the session (worker process) that joined with it, named by its random
incarnation, which every push, pull, heartbeat and leave of the rank carries; a request under a
rank with another (or no) incarnation is refused before it changes anything (``_member``). One job
per server: a worker whose model, mode, optimizer or world differs is refused at its join, naming
the differences. What the job holds beyond its parameters (gradient buffers, copies for pulls,
their encodings, compressed payloads being decoded) is counted against ``capacity`` (budget.py).

All state is changed on the event loop; optimizer steps and gradient sums run in one worker thread
(torch releases the GIL), so the loop keeps receiving the next push meanwhile. Pulls read the
parameters under a shared lock that a step takes exclusively, so a pull never sees half a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from tensorwire.compression import Codec, decode_all, from_wire, payload_total
from tensorwire.errors import (
    AuthenticationError,
    CapacityExceeded,
    InvalidTensor,
    LimitExceeded,
    NotPrimary,
    ProtocolError,
    ReplicationRefused,
    WaitTimeout,
    WorkerDropped,
)
from tensorwire.logs import event
from tensorwire.ps import checkpoint, replication
from tensorwire.ps import metrics as ps_metrics
from tensorwire.ps.budget import Budget
from tensorwire.ps.exchange_server import GradientExchange, frame_session
from tensorwire.ps.job import CheckpointPolicy, JobConfig, Mode
from tensorwire.security import Security
from tensorwire.server.core import Handler, Request
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view

__all__ = ["CheckpointPolicy", "JobConfig", "Mode", "ParamServer"]

log = logging.getLogger("tensorwire.ps")
T = TypeVar("T")
MAX_STALENESS_BUCKET = 1000  # the histogram's last bucket holds everything above
MAX_WORLD = 1 << 16
MAX_SNAPSHOTS = 4  # older copies of the parameters that slow pulls may still be sending from
MAX_PULL_CODECS = 4  # codecs one version of the parameters is kept encoded in for pulls


@dataclass(eq=False)
class _Shard:
    key: str
    param: torch.nn.Parameter  # flat, 1-D
    version: int = 0

    @property
    def meta(self) -> TensorMeta:
        p = self.param
        return TensorMeta(self.key, p.dtype, (p.numel(),), p.numel() * p.element_size(), self.version)


@dataclass(eq=False)
class _Worker:
    clock: int = 0  # pushes recorded (sync) or applied (async, ssp)
    live: bool = True
    read_clock: int = 0  # the slowest live clock when this worker last pulled
    pushing: bool = False
    seq: int = 0  # the highest push sequence number applied: a resend at or below it is a duplicate
    incarnation: int = 0  # which process holds the rank (PS_JOIN's seq field)
    last_reply: bytes = b""  # the answer to push ``seq``, sent again to a resend of it
    heard: float = field(default_factory=time.monotonic)  # its last request or heartbeat


_Grads = list[torch.Tensor | None]  # one per shard of the server; None: no gradient for it


@dataclass(eq=False)
class _Snapshot:
    """A copy of the parameters at one version, which pulls send from (see ``_published``)."""

    generation: int  # of the job's shards (a restore makes new ones)
    version: int
    metas: dict[str, TensorMeta]
    tensors: dict[str, torch.Tensor]
    readers: int = 0  # pulls sending from it right now
    encoded: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # by codec: payloads
    held: int = 0  # bytes of its tensors and encodings, counted in the server's budget


@dataclass(eq=False)
class _Pending:
    """The gradients pushed for one clock of a sync job, by worker: (its buffers, its gradients)."""

    grads: dict[int, tuple[_Grads, _Grads]] = field(default_factory=dict)


class _SharedLock:
    """Many readers (pulls) or one writer (a step); a waiting writer goes before new readers."""

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._changed:
            self._writers_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._writer and not self._readers)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._changed:
                self._writer = False
                self._changed.notify_all()


class ParamServer:
    """One server's shards of a job's parameters, with their optimizer (see the module doc).

    ``capacity``: the most bytes the job may hold here, its parameters and what pushes and pulls
    keep (budget.py); ``tensorwire serve`` passes its ``--capacity``.
    """

    def __init__(
        self,
        wait_timeout: float = 120.0,
        workers: int = 1,
        capacity: int = 1 << 62,
        *,
        heartbeat_timeout: float = 0.0,
        checkpoints: CheckpointPolicy | None = None,
        backups: Sequence[str] = (),
        standby: bool = False,
        failover_timeout: float = 2.0,
        peer: Security | None = None,
    ) -> None:
        self.wait_timeout = wait_timeout
        # Most bytes the job may hold here: its parameters and what pushes and pulls keep (budget.py).
        self.capacity = capacity
        self.budget = Budget(capacity)
        self.identity_refused = 0  # requests under a rank that another session holds
        self.jobs_refused = 0  # joins and inits of another job (model, mode, optimizer, world)
        self.checkpoints_skipped = 0  # newer checkpoints passed over at a restore: not complete
        self.restored_from: str | None = None  # the checkpoint this server's job came from
        # A live worker not heard from (request or heartbeat) for this long is dropped from the
        # job, so that sync steps go on without it; 0 turns it off.
        self.heartbeat_timeout = heartbeat_timeout
        self.checkpoints = checkpoints
        self.duplicates = 0  # resent pushes answered without being applied again
        self.dropped = 0  # workers dropped for missed heartbeats
        self._last_checkpoint = time.monotonic()
        self._watchdog: asyncio.Task[None] | None = None
        # Replication (ps/replication.py): a primary sends every change to its backups first.
        self.role = "backup" if standby else "primary"
        self.epoch = 0 if standby else 1
        self.failover_timeout = failover_timeout
        self.failovers = 0
        # How this replica reaches the others of its slot, and what they must offer it: the peer
        # token (and TLS files for tls:// peers). Without one any client could demote or fence it.
        self.peer = peer or Security()
        if (backups or standby) and not self.peer.token:
            raise ValueError(
                "a replicated parameter server (backups or standby) needs a peer token shared by "
                "its slot's replicas (serve --peer-token-file; ParamServer(peer=Security(token=...)))"
            )
        self.replicate_refused: Counter[str] = Counter()  # PS_REPLICATE frames refused, by reason
        # A backup that stops answering (stopped, cut off) holds up every change until it is given
        # up on; long enough for a state transfer, short next to a worker's timeout.
        replicate_timeout = max(5.0, 4 * failover_timeout)
        self._backups = (
            replication.Backups(backups, self.peer, timeout=replicate_timeout) if backups else None
        )
        self._ordered: asyncio.Lock | None = None  # changes are made (and replicated) one at a time
        self._primary_seen: float | None = None
        self._pinging: asyncio.Task[None] | None = None
        # The gradient exchange (ALLREDUCE, gRPC GradientService) rides on the same server.
        self.exchange = GradientExchange(workers, wait_timeout, capacity)
        self.config: JobConfig | None = None
        self.shards: dict[str, _Shard] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.workers: dict[int, _Worker] = {}
        self.world = 0
        self.step = 0  # sync: steps taken; the clock the next step is for
        self.version = 0  # updates applied, in any mode
        self.pushes = 0
        self.staleness: Counter[int] = Counter()
        self._initializing = False
        self._pending: dict[int, _Pending] = {}
        self._free: list[_Grads] = []  # gradient buffers for reuse (fresh pages are slow)
        self._changed: asyncio.Event | None = None  # set (and dropped) at every change of state
        self._lock = _SharedLock()
        self._applying: asyncio.Lock | None = None
        self._generation = 0  # bumped when the shards are replaced (a job created, a checkpoint restored)
        self._current: _Snapshot | None = None  # the copy pulls send from
        self._retired: list[_Snapshot] = []
        self._publishing: asyncio.Lock | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tensorwire-ps")

    # -- the extension seam ---------------------------------------------------------------------
    def frame_handlers(self) -> Mapping[int, Handler]:
        return {
            Opcode.PS_INIT: self._on_init,
            Opcode.PS_JOIN: self._on_join,
            Opcode.PS_LEAVE: self._on_leave,
            Opcode.PS_PUSH: self._on_push,
            Opcode.PS_PULL: self._on_pull,
            Opcode.PS_STATS: self._on_stats,
            Opcode.ALLREDUCE: self.exchange.on_allreduce,
            Opcode.PS_HEARTBEAT: self._on_heartbeat,
            Opcode.PS_ROLLBACK: self._on_rollback,
            Opcode.PS_REPLICATE: self._on_replicate,
        }

    def rpc_handlers(self) -> Sequence[Any]:
        return (self.exchange.rpc_handler(),)

    def collectors(self) -> list[Any]:
        """Its Prometheus families (ps/metrics.py), for the server's registry."""
        return [ps_metrics.PsCollector(self)]

    def status(self) -> dict[str, Any]:
        """Its part of the server's STATUS answer (``tensorwire status``)."""
        doc = {**self.stats(), "live": self.live(), **ps_metrics.replication_status(self)}
        doc["shard_keys"] = list(self.shards)[:64]  # a sample: the count is in "shards"
        return {"ps": doc}

    @property
    def backups(self) -> replication.Backups | None:
        return self._backups

    @property
    def peer_token(self) -> str | None:
        """The slot's peer token: the server opens a peer session for a HELLO that offers it."""
        return self.peer.token

    @property
    def primary_seen(self) -> float | None:
        """When (monotonic) a backup last heard from its primary."""
        return self._primary_seen

    async def close(self) -> None:
        """The server is stopping (SIGTERM): stop watching heartbeats, write a last checkpoint."""
        for task in (self._watchdog, self._pinging):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._watchdog = self._pinging = None
        if self._backups is not None:
            await self._backups.close()
        if self.checkpoints is not None and self.config is not None:
            await self._checkpoint()
        self._thread.shutdown(wait=True)

    # -- state queries --------------------------------------------------------------------------
    @property
    def mode(self) -> Mode | None:
        return self.config.mode if self.config else None

    def live(self) -> list[int]:
        return sorted(w for w, state in self.workers.items() if state.live)

    def slowest(self) -> int:
        """The slowest live worker's clock; 0 while some of the ``world`` have not joined yet."""
        if len(self.workers) < self.world:
            return 0
        clocks = [state.clock for state in self.workers.values() if state.live]
        return min(clocks) if clocks else 0

    def stats(self) -> dict[str, Any]:
        """What ``PS_STATS`` answers (and ``tensorwire ps stats`` prints)."""
        return {
            "mode": str(self.mode) if self.mode else None,
            "optimizer": self.config.optimizer.to_dict() if self.config else None,
            "world": self.world,
            "step": self.step,
            "version": self.version,
            "pushes_applied": self.pushes,
            "shards": len(self.shards),
            "bytes": sum(s.meta.nbytes for s in self.shards.values()),
            "workers": {
                str(w): {"clock": s.clock, "live": s.live, "seq": s.seq}
                for w, s in sorted(self.workers.items())
            },
            "duplicates_ignored": self.duplicates,
            "role": self.role,
            "epoch": self.epoch,
            "failovers": self.failovers,
            "pulls_sending": sum(s.readers for s in [*self._retired, *filter(None, [self._current])]),
            "workers_dropped": self.dropped,
            "identity_refused": self.identity_refused,
            "jobs_refused": self.jobs_refused,
            "capacity": self.capacity,
            "held_bytes": dict(self.budget.held),
            "capacity_refused": self.budget.refused,
            "checkpoint": {"restored": self.restored_from, "skipped": self.checkpoints_skipped},
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "max_staleness": max(self.staleness, default=0),
        }

    # -- handlers -------------------------------------------------------------------------------
    async def _on_init(self, request: Request) -> None:
        self._serving()
        head = wps.PsHead.decode(request.meta)
        config = JobConfig.from_json(wps.decode_config(request.meta))
        metas = wm.decode_records(request.meta)
        request.meta.done()
        # Without data it only checks that the server's job is the worker's (a rejoining worker).
        check_only = request.header.data_len == 0 and any(m.nbytes for m in metas)
        _check_records(metas, None if check_only else request.header.data_len)
        if check_only and self.config is None and not self._initializing:
            raise ProtocolError("PS_INIT without values, but this server has no job yet")
        self._check_worker(head)
        if self.config is None and not self._initializing:
            copies = 1 + config.optimizer.state_copies
            self.budget.check(copies * request.header.data_len, "the job's parameters and optimizer state")
        if self.config is None and not self._initializing:
            await self._create(request, head, config, metas)
            await request.reply(wps.encode_init_reply(True, self.step))
            return
        await request.skip()  # someone else's values won: this worker pulls them
        with request.waiting():
            ready = lambda: self.config is not None or not self._initializing  # noqa: E731
            await self._wait(ready, head, "the job's parameters to be initialised")
        if self.config is None:  # the worker creating it failed: this one may try again
            raise WorkerDropped("the worker that was creating the job failed: initialise it again")
        self._check_same_job(config, metas)
        await request.reply(wps.encode_init_reply(False, self.step))

    async def _create(
        self, request: Request, head: wps.PsHead, config: JobConfig, metas: list[TensorMeta]
    ) -> None:
        self._initializing = True
        try:
            values = [torch.empty(m.numel, dtype=m.dtype) for m in metas]
            await request.receive([byte_view(v) for v in values])
            async with self._in_order():
                body = wps.encode_config(config.to_json()) + wm.encode_records(metas)
                await self._replicate(replication.Change.CREATE, head, body, [byte_view(v) for v in values])
                self._install(head, config, metas, values)
        finally:
            self._initializing = False
            self._notify()

    def _install(
        self, head: wps.PsHead, config: JobConfig, metas: list[TensorMeta], values: list[torch.Tensor]
    ) -> None:
        shards = {m.name: _Shard(m.name, torch.nn.Parameter(v)) for m, v in zip(metas, values, strict=True)}
        self.optimizer = config.optimizer.build(s.param for s in shards.values())
        self.shards, self.config = shards, config
        self._count_job()
        self._generation += 1
        self._note_world(head.world)
        log.info("job initialised: %d shards, mode %s, %s", len(shards), config.mode, config.optimizer)

    def _count_job(self) -> None:
        """The job's parameters and its optimizer's state, in the budget (made or restored)."""
        assert self.config is not None
        params = sum(s.meta.nbytes for s in self.shards.values())
        self.budget.set("params", params)
        self.budget.set("optimizer", params * self.config.optimizer.state_copies)

    async def _on_join(self, request: Request) -> None:
        self._serving()
        head = wps.PsHead.decode(request.meta)
        job = self._described_job(request.meta)
        request.meta.done()
        self._check_worker(head)
        if not head.seq:
            raise ProtocolError("PS_JOIN needs the worker process's incarnation (random, not 0) in seq")
        self._check_joining_job(job)  # a worker of another job changes nothing, not even by waiting
        with request.waiting():  # a restarted worker: its old process is dropped after its heartbeats
            await self._wait(lambda: self._rank_free(head), head, f"rank {head.worker} to be freed")
        async with self._in_order():
            async with self._step_lock():  # a step being taken does not count it
                self._check_rank_free(head)
                self._check_joining_job(job)  # the job may have been created meanwhile
                await self._replicate(replication.Change.JOIN, head)
                reply = self._admit(head)
            await self._apply_ready_steps()  # a rejoin for the next step may complete this one
        await request.reply(reply)

    @staticmethod
    def _described_job(reader: wm.MetaReader) -> tuple[JobConfig, list[TensorMeta]] | None:
        """The job a PS_JOIN says its worker belongs to (PS_INIT's config and records), if it does."""
        if not reader.remaining:
            return None  # an older worker: its PS_INIT checks the job
        config = JobConfig.from_json(wps.decode_config(reader))
        metas = wm.decode_records(reader)
        _check_records(metas, None)
        return config, metas

    def _check_joining_job(self, job: tuple[JobConfig, list[TensorMeta]] | None) -> None:
        if job is not None and self.config is not None:
            self._check_same_job(*job)

    def _rank_free(self, head: wps.PsHead) -> bool:
        before = self.workers.get(head.worker)
        return before is None or not before.live or before.incarnation == head.seq or not self._alive(before)

    def _joining_clock(self, worker: int) -> int:
        """Where a joining worker starts. Sync: the current step, or the next one when pushes for
        the current one are in already (that step goes on without the newcomer: its workers need
        not wait, and servers that are a step apart agree on where the newcomer starts). A rank
        joining for the first time always starts at the current step: no step is taken before
        every rank joined, so that step waits for it anyway, and a worker started a little later
        than the others (a slow machine) must not shift the whole run by a step."""
        if not self.mode or self.mode.kind != "sync":
            return self.slowest()
        pending = self._pending.get(self.step)
        rejoin = worker in self.workers
        return self.step + 1 if rejoin and pending is not None and pending.grads else self.step

    def _check_rank_free(self, head: wps.PsHead) -> None:
        if not self._rank_free(head):
            raise ProtocolError(
                f"rank {head.worker} is held by another live process (a second worker with the same RANK?); "
                "it is freed when that one leaves or misses its heartbeats"
            )

    def _admit(self, head: wps.PsHead) -> bytes:
        """Make ``head.worker`` live at the current step (sync) or the slowest clock; the answer."""
        self._note_world(head.world)
        before = self.workers.get(head.worker)  # a rejoin keeps its push marks: resends stay duplicates
        clock = self._joining_clock(head.worker)
        seq, reply = (before.seq, before.last_reply) if before else (0, b"")
        self.workers[head.worker] = _Worker(
            clock, read_clock=clock, seq=seq, last_reply=reply, incarnation=head.seq
        )
        log.info("worker %d joined at clock %d (live: %s)", head.worker, clock, self.live())
        self._start_watchdog()
        self._notify()
        return wps.encode_join_reply(clock, self.config is not None, seq)

    async def _on_leave(self, request: Request) -> None:
        self._serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        state = self.workers.get(head.worker)
        member = state is not None and state.live and state.incarnation == head.seq
        session = frame_session(request, head)
        # The job's worker of that rank, or the exchange client that holds it in the exchange (a
        # program may use both under one rank); anyone else changes nothing.
        held = self.exchange.held_by(head.worker, session)
        if state is not None and state.live and head.seq and not member and not held:
            self._refuse_identity(request, head, head.seq)
        self.exchange.leave(head.worker, session, strict=not member)
        if member:
            async with self._in_order():
                await self._replicate(replication.Change.LEAVE, head)
                await self._leave(head.worker, "left")
        await request.reply(b"")

    async def _leave(self, worker: int, why: str) -> None:
        state = self.workers[worker]
        state.live = False
        log.info("worker %d %s at clock %d (live: %s)", worker, why, state.clock, self.live())
        self._notify()
        await self._apply_ready_steps()

    async def _on_push(self, request: Request) -> None:
        self._serving()
        head = wps.PsHead.decode(request.meta)
        metas = wm.decode_records(request.meta)
        codec_name, incarnation = wps.decode_push_tail(request.meta)
        codec = from_wire(codec_name)
        request.meta.done()
        state = self._member(request, head, incarnation)
        if state.pushing:  # a resend racing the original (the client timed out): let it finish first
            with request.waiting():
                await self._wait(lambda: not state.pushing, head, f"worker {head.worker}'s push in flight")
            if self.workers.get(head.worker) is not state or not state.live:
                raise WorkerDropped(f"worker {head.worker} left or rejoined while its push waited: rejoin")
        if head.seq <= state.seq:  # applied already: answer as the first time, apply nothing
            await request.skip()
            self.duplicates += 1
            log.info("worker %d resent push %d: answered, not applied again", head.worker, head.seq)
            stale = wps.encode_push_reply(self.version, 0)
            await request.reply(state.last_reply if head.seq == state.seq else stale)
            return
        self._check_push(head, state)
        shards, present = self._shards_for(metas, request.header.data_len, codec)
        buffers = self._take_buffers(shards)
        grads = [b if p else None for b, p in zip(buffers, present, strict=True)]
        state.pushing = True  # one push per worker at a time: a second one is refused, not merged
        accepted = False
        try:
            data = await self._receive_grads(request, codec, grads)
            # The backups' body is the one older releases sent (no incarnation: the primary vouches).
            body = wm.encode_records(metas) + wps.encode_codec(codec.name if codec else None)
            async with self._in_order():
                # Backups get the payloads as they came and decode them with the same code, so
                # they hold the same bits (and replication moves the compressed bytes).
                await self._replicate(replication.Change.PUSH, head, body, data)
                accepted = True
                await self._accept(head, state, buffers, grads)
        finally:
            if not accepted:  # refused or broken: its buffers are kept (and counted) for the next push
                self._free.append(buffers)
            state.pushing = False
            self._notify()
        await request.reply(state.last_reply)

    async def _receive_grads(self, request: Request, codec: Codec | None, grads: _Grads) -> list[memoryview]:
        """Receive a push's data into ``grads``: raw bytes straight in, or a codec's payloads,
        decoded (once, on the optimizer's thread) before anything is replicated or applied, so a
        payload that does not decode changes nothing. Returns the data as received."""
        present = [g for g in grads if g is not None]
        if codec is None:
            data = [byte_view(g) for g in present]
            await request.receive(data)
            return data
        # Sizes from this server's own shards (``_shards_for`` checked the records against them),
        # counted before they are allocated; the decode runs on the optimizer's thread.
        sizes = [codec.payload_bytes(g.numel()) for g in present]
        self.budget.reserve("payloads", sum(sizes), f"the {codec.name} payloads of a push")
        try:
            payloads = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            data = [byte_view(p) for p in payloads]
            await request.receive(data)
            await self._run(decode_all, codec, payloads, present)
        finally:
            # Decoded: what is left of them is the replication that follows (one push per worker).
            self.budget.release("payloads", sum(sizes))
        return data

    async def _accept(self, head: wps.PsHead, state: _Worker, buffers: _Grads, grads: _Grads) -> None:
        """Record (sync) or apply (async, ssp) a received push; then the worker's clock moves on,
        so an ssp gate opens only once the update it waits for is in the parameters."""
        assert self.config is not None
        if self.config.mode.kind == "sync":
            self._pending.setdefault(head.clock, _Pending()).grads[head.worker] = (buffers, grads)
            self._record(0)
            self._mark(head, state, 0)
            await self._apply_ready_steps()
            return
        staleness = self.staleness_of(head, state)
        await self._apply(grads, pushes=1)
        self._free.append(buffers)
        self._record(staleness)
        self._mark(head, state, staleness)
        await self._maybe_checkpoint()

    def _mark(self, head: wps.PsHead, state: _Worker, staleness: int) -> None:
        """The push is in: the worker's clock moves on and its sequence number is remembered."""
        state.clock = head.clock + 1
        state.seq = head.seq
        state.last_reply = wps.encode_push_reply(self.version, staleness)
        self._notify()

    def staleness_of(self, head: wps.PsHead, state: _Worker) -> int:
        """Clocks the push's parameters may lag the slowest worker's updates by (module doc)."""
        if self.config is None or self.config.mode.kind == "sync":
            return 0
        return head.clock - state.read_clock

    async def _on_pull(self, request: Request) -> None:
        self._serving()
        head = wps.PsHead.decode(request.meta)
        names = wm.decode_names(request.meta)
        codec = from_wire(wps.decode_codec(request.meta))
        request.meta.done()
        if codec is not None and codec.sparse:
            raise ProtocolError(f"{codec.name} drops elements: parameters cannot be pulled in it")
        with request.waiting():
            await self._wait(lambda: self.config is not None, head, "the job's parameters to be initialised")
        for name in names:
            self._shard(name)  # ProtocolError for a shard this server does not hold
        if len(set(names)) != len(names):
            raise ProtocolError("PS_PULL names the same shard twice")
        state = self._member(request, head, head.seq) if head.worker != wps.OBSERVER else None
        if state is not None:
            with request.waiting():
                await self._gate(head, state)
            read = self.slowest() if self.mode and self.mode.kind != "sync" else head.clock
            if read != state.read_clock:
                async with self._in_order():
                    await self._replicate(replication.Change.READ, head._replace(clock=read))
                    state.read_clock = read
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
            self._notify()

    async def _published(self, head: wps.PsHead) -> _Snapshot:
        """A copy of the parameters at the current version, made by the first pull after a step and
        shared by the pulls that follow. Pulls send from it without holding the parameters' lock,
        so a slow reader never holds up a step; the copy is one memcpy per version."""
        if self._publishing is None:
            self._publishing = asyncio.Lock()
        async with self._publishing:
            current = self._current
            if (
                current is not None
                and current.version == self.version
                and current.generation == self._generation
            ):
                return current
            room = lambda: sum(s.readers > 0 for s in self._retired) < MAX_SNAPSHOTS  # noqa: E731
            await self._wait(room, head, f"one of {MAX_SNAPSHOTS} slow pulls to finish")
            async with self._lock.shared():  # no step while the values are copied
                fresh = self._spare_snapshot()
                await self._run(_copy_shards, fresh, self.shards)
                fresh.version = self.version
                fresh.metas = {key: shard.meta for key, shard in self.shards.items()}
                self._drop_encodings(fresh)
            if current is not None:
                self._retired.append(current)
            self._current = fresh
            return fresh

    async def _encoded(self, snapshot: _Snapshot, codec: Codec) -> dict[str, torch.Tensor]:
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
                    nbytes = sum(codec.payload_bytes(t.numel()) for t in snapshot.tensors.values())
                    self._make_room(nbytes)
                    self.budget.reserve("snapshots", nbytes, f"the parameters encoded in {codec.name}")
                    snapshot.held += nbytes
                    cached = await self._run(_encode_all, codec, snapshot.tensors)
                    snapshot.encoded[codec.name] = cached
        return cached

    def _drop_encodings(self, snapshot: _Snapshot) -> None:
        nbytes = sum(map(_nbytes, (list(e.values()) for e in snapshot.encoded.values())))
        snapshot.encoded = {}
        snapshot.held -= nbytes
        self.budget.release("snapshots", nbytes)

    def _spare_snapshot(self) -> _Snapshot:
        """A retired copy nobody is sending from any more (its buffers are reused: fresh pages
        cost more than the copy), or a new one."""
        idle = [s for s in self._retired if s.readers == 0 and s.generation == self._generation]
        for gone in [s for s in self._retired if s.readers == 0 and s is not (idle[0] if idle else None)]:
            self.budget.release("snapshots", gone.held)
        self._retired = [s for s in self._retired if s.readers > 0]
        if idle:
            return idle[0]
        nbytes = sum(shard.meta.nbytes for shard in self.shards.values())
        self._make_room(nbytes)
        self.budget.reserve("snapshots", nbytes, "a copy of the parameters for pulls")
        tensors = {key: torch.empty_like(shard.param.data) for key, shard in self.shards.items()}
        return _Snapshot(self._generation, -1, {}, tensors, held=nbytes)

    async def _on_heartbeat(self, request: Request) -> None:
        self._serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        state = self.workers.get(head.worker)
        live = state is not None and state.live and state.incarnation == head.seq
        if live:
            assert state is not None
            state.heard = time.monotonic()
        await request.reply(wps.encode_u32(int(live)))

    async def _on_rollback(self, request: Request) -> None:
        """Go back to the checkpoint of version ``clock``: after a restart of several servers,
        workers bring them all to the newest version every one of them has."""
        self._serving()
        head = wps.PsHead.decode(request.meta)
        request.meta.done()
        if self.live():
            raise ProtocolError(f"cannot roll back while workers {self.live()} are live")
        directory = self.checkpoints.directory if self.checkpoints is not None else None
        # Read first (off the loop): a checkpoint that is not complete changes nothing, here or on a backup.
        snapshot = await self._run(checkpoint.load, directory, head.clock) if directory else None
        if snapshot is None:
            raise WorkerDropped(f"no checkpoint of version {head.clock} here to roll back to")
        async with self._in_order():
            await self._replicate(replication.Change.ROLLBACK, head)
            self._restored(snapshot)
        await request.reply(wps.encode_u64(self.version))

    async def _on_stats(self, request: Request) -> None:
        wps.PsHead.decode(request.meta)
        request.meta.done()
        await request.reply(wps.encode_stats(json.dumps(self.stats(), sort_keys=True)))

    # -- replication ----------------------------------------------------------------------------
    def _in_order(self) -> asyncio.Lock:
        if self._ordered is None:
            self._ordered = asyncio.Lock()
        return self._ordered

    def _serving(self) -> None:
        """Refuse a worker's request unless this replica is the primary. A backup whose primary has
        been silent for ``failover_timeout`` takes over first."""
        if self.role == "primary":
            if self._backups is not None and self._pinging is None:
                self._pinging = asyncio.get_running_loop().create_task(self._ping_backups())
            return
        seen = self._primary_seen
        if self.role == "backup" and seen is not None and time.monotonic() - seen > self.failover_timeout:
            self._promote()
            return
        raise NotPrimary(f"this replica is a {self.role} at epoch {self.epoch}: ask another one")

    def _promote(self) -> None:
        if self.epoch + 1 >= replication.MAX_EPOCH:  # cannot happen: epochs are checked on receipt
            raise NotPrimary(f"this backup is at the last epoch ({self.epoch}) and cannot take over")
        self.role = "primary"
        self.epoch += 1
        self.failovers += 1
        now = time.monotonic()
        for state in self.workers.values():
            state.heard = now  # a grace period: the workers are moving over from the old primary
        self._start_watchdog()
        if self._backups is not None and self._pinging is None:  # its peers become its backups
            self._backups.reset()
            self._pinging = asyncio.get_running_loop().create_task(self._ping_backups())
        event(log, logging.WARNING, "failover: this backup takes over", epoch=self.epoch, step=self.step,
              version=self.version, silent_s=round(now - (self._primary_seen or now), 3))  # fmt: skip

    async def _replicate(
        self, change: replication.Change, head: wps.PsHead, body: bytes = b"", data: Sequence[memoryview] = ()
    ) -> None:
        """Apply a change on every backup before making it here (inside ``_in_order``). A backup
        that is new, or back, first gets the whole job (a state transfer)."""
        if self.role != "primary":
            # It stepped down (fenced, or following a newer primary) while this request waited
            # for its turn: the change must not be made or acknowledged here, only by the primary.
            raise NotPrimary(f"this replica became a {self.role} at epoch {self.epoch}: ask another one")
        if self._backups is None:
            return
        meta = replication.encode(change, self.epoch, head, body)
        try:
            await self._backups.send(meta, data, self._state_transfer, ping=change == replication.Change.PING)
        except NotPrimary:
            self.role = "fenced"
            event(log, logging.ERROR, "fenced: a backup took over from this primary", epoch=self.epoch)
            raise NotPrimary("this primary was fenced: a backup took over; ask another replica") from None

    def _state_transfer(self) -> tuple[bytes, list[memoryview]] | None:
        """The SYNC change: the whole job, as it is between two changes (we are in ``_in_order``)."""
        if self.config is None:
            return None
        snapshot = self._snapshot(live=True)
        tensors = {**snapshot.params, **{f"@optimizer/{k}": v for k, v in snapshot.optimizer.items()}}
        metas = [
            TensorMeta(k, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for k, t in tensors.items()
        ]
        body = wps.encode_stats(json.dumps(snapshot.state)) + wm.encode_records(metas)
        head = wps.PsHead(wps.OBSERVER, self.world)
        meta = replication.encode(replication.Change.SYNC, self.epoch, head, body)
        return meta, [byte_view(t.contiguous()) for t in tensors.values()]

    async def _ping_backups(self) -> None:
        while self.role == "primary":
            async with self._in_order():
                # Fenced: the loop ends. A backup refusing the credentials: logged and shown by
                # Backups; the next ping tries again (it may have been fixed).
                with contextlib.suppress(NotPrimary, ReplicationRefused):
                    await self._replicate(replication.Change.PING, wps.PsHead(wps.OBSERVER))
            await asyncio.sleep(replication.PING_SECONDS)

    async def _on_replicate(self, request: Request) -> None:
        """A backup applies its primary's change, exactly as the primary did. Only a replica of this
        slot may send one (a peer session: its HELLO offered the peer token), with an epoch in
        range; anything else is refused before any state changes."""
        if not request.from_peer:
            self._refuse_replicate(request, "not_peer")
            raise AuthenticationError(
                "PS_REPLICATE is served only to the replicas of this server's slot (a connection "
                "whose HELLO offered the peer token of serve --peer-token-file)"
            )
        try:
            head, change, epoch = replication.decode(request.meta)
        except ProtocolError:
            self._refuse_replicate(request, "malformed")
            raise
        if epoch < self.epoch or (epoch == self.epoch and self.role != "backup"):
            await request.skip()
            raise NotPrimary(f"epoch {epoch} is over: this replica is a {self.role} at epoch {self.epoch}")
        if self.role != "backup":
            # A newer primary: it took over from this one (which was slow or cut off, or fenced
            # already). Step down and follow it; its state transfer comes first. Refusing would
            # fence it too and leave the slot with no primary.
            log.warning("a primary at epoch %d took over from this %s (epoch %d): following it",
                        epoch, self.role, self.epoch)  # fmt: skip
            self.role = "backup"
        self.epoch, self._primary_seen = epoch, time.monotonic()
        if change == replication.Change.SYNC:
            await self._receive_state(request)
        elif change == replication.Change.CREATE:
            config = JobConfig.from_json(wps.decode_config(request.meta))
            metas = wm.decode_records(request.meta)
            _check_replicated(metas, request.header.data_len, self.capacity)  # before allocating
            values = [torch.empty(m.numel, dtype=m.dtype) for m in metas]
            await request.receive([byte_view(v) for v in values])
            self._install(head, config, metas, values)
        elif change == replication.Change.JOIN:
            async with self._step_lock():
                self._admit(head)
            await self._apply_ready_steps()
        elif change in (replication.Change.LEAVE, replication.Change.DROP):
            await self._leave(head.worker, "left (replicated)")
        elif change == replication.Change.PUSH:
            await self._apply_replicated_push(request, head)
        elif change == replication.Change.READ:
            self.workers[head.worker].read_clock = head.clock
        elif change == replication.Change.ROLLBACK and self.checkpoints is not None:
            self.restore(self.checkpoints.directory, head.clock)
        request.meta.done()
        await request.reply(b"")

    def _refuse_replicate(self, request: Request, reason: str) -> None:
        self.replicate_refused[reason] += 1
        event(log, logging.WARNING, "replication request refused", peer=request.peer, reason=reason,
              role=self.role, epoch=self.epoch)  # fmt: skip

    async def _receive_state(self, request: Request) -> None:
        state = json.loads(wps.decode_stats(request.meta))
        metas = wm.decode_records(request.meta)
        if sum(m.nbytes for m in metas) != request.header.data_len:  # what is allocated is what is sent
            raise InvalidTensor("the state transfer's records do not add up to its data length")
        tensors = {m.name: torch.empty(m.shape, dtype=m.dtype) for m in metas}
        await request.receive([byte_view(t) for t in tensors.values()])
        optimizer = {
            k.removeprefix("@optimizer/"): t for k, t in tensors.items() if k.startswith("@optimizer/")
        }
        params = {k: t for k, t in tensors.items() if not k.startswith("@optimizer/")}
        self._load(checkpoint.Snapshot(state, params, optimizer))
        self._generation += 1
        log.info("state transfer from the primary: step %d, version %d", self.step, self.version)

    async def _apply_replicated_push(self, request: Request, head: wps.PsHead) -> None:
        metas = wm.decode_records(request.meta)
        codec = from_wire(wps.decode_codec(request.meta))
        state = self.workers[head.worker]
        shards, present = self._shards_for(metas, request.header.data_len, codec)
        buffers = self._take_buffers(shards)
        grads = [b if p else None for b, p in zip(buffers, present, strict=True)]
        await self._receive_grads(request, codec, grads)
        await self._accept(head, state, buffers, grads)

    # -- membership -----------------------------------------------------------------------------
    def _alive(self, state: _Worker) -> bool:
        """Whether a live worker was heard from lately (always, without heartbeat checks: then
        only its PS_LEAVE frees the rank)."""
        return not self.heartbeat_timeout or time.monotonic() - state.heard < self.heartbeat_timeout

    def _start_watchdog(self) -> None:
        if self.heartbeat_timeout > 0 and self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_heartbeats())

    async def _watch_heartbeats(self) -> None:
        """Drop live workers not heard from for ``heartbeat_timeout``: sync steps go on without them."""
        while True:
            await asyncio.sleep(self.heartbeat_timeout / 4)
            if self.role != "primary":  # workers beat to the primary; a backup learns drops from it
                continue
            now = time.monotonic()
            silent = [w for w, s in self.workers.items() if s.live and not s.pushing
                      and now - s.heard > self.heartbeat_timeout]  # fmt: skip
            for worker in silent:
                self.exchange.leave(worker)
                self.dropped += 1
                async with self._in_order():
                    # Stepped down meanwhile: its primary decides. A backup refusing the credentials:
                    # the drop is not made (the worker stays live); the next round tries again.
                    with contextlib.suppress(NotPrimary, ReplicationRefused):
                        await self._replicate(replication.Change.DROP, wps.PsHead(worker))
                        await self._leave(worker, f"dropped (no heartbeat for {self.heartbeat_timeout:.3g}s)")

    # -- checkpoints ----------------------------------------------------------------------------
    async def _maybe_checkpoint(self) -> None:
        policy = self.checkpoints
        if policy is None:
            return
        by_steps = policy.every_steps and self.version % policy.every_steps == 0
        by_time = policy.every_seconds and time.monotonic() - self._last_checkpoint >= policy.every_seconds
        if by_steps or by_time:
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        """Write the job's state. It runs on the optimizer's thread, after the step that made it,
        so no step changes the parameters while they are written (pulls only read them)."""
        assert self.checkpoints is not None
        async with self._lock.exclusive():  # no step in between: the counters match the tensors
            snapshot = self._snapshot()
            path = await self._run(checkpoint.save, self.checkpoints.directory, self.version, snapshot)
        self._last_checkpoint = time.monotonic()
        log.info("checkpoint %s written (step %d, version %d)", path, self.step, self.version)

    def _snapshot(self, *, live: bool = False) -> checkpoint.Snapshot:
        """The job's state; ``live`` adds what a backup taking over needs beyond a checkpoint: the
        workers' liveness and read clocks and the pushes of a sync step not taken yet."""
        assert self.config is not None and self.optimizer is not None
        tensors, optimizer_rest = checkpoint.optimizer_tensors(self.optimizer.state_dict())
        state = {
            "config": json.loads(self.config.to_json()),
            "shards": list(self.shards),
            "versions": {key: shard.version for key, shard in self.shards.items()},
            "world": self.world,
            "step": self.step,
            "version": self.version,
            "pushes": self.pushes,
            "workers": {str(w): [s.clock, s.seq, s.last_reply.hex()] for w, s in self.workers.items()},
            "optimizer": optimizer_rest,
        }
        params = {key: shard.param.detach() for key, shard in self.shards.items()}
        if live:
            state["live"] = {str(w): [s.live, s.read_clock, s.incarnation] for w, s in self.workers.items()}
            state["pending"] = {}
            for clock, pending in self._pending.items():
                for worker, (_, grads) in pending.grads.items():
                    present = [i for i, g in enumerate(grads) if g is not None]
                    state["pending"].setdefault(str(clock), {})[str(worker)] = present
                    for i in present:
                        grad = grads[i]
                        assert grad is not None
                        params[f"@pending/{clock}/{worker}/{i}"] = grad
        return checkpoint.Snapshot(state, params, tensors)

    def restore(self, directory: Path, version: int | None = None) -> bool:
        """Load the newest complete checkpoint (of ``version``, if given) of ``directory``, if there
        is one; newer ones that are not complete (torn by a crash) are skipped, and that is said in
        the log and in ``stats()["checkpoint"]``. Its workers come back as not live: each rejoins
        (``ps.Worker`` does it by itself)."""
        snapshot = checkpoint.load(directory, version)
        if snapshot is None:
            return False
        self._restored(snapshot)
        return True

    def _restored(self, snapshot: checkpoint.Snapshot) -> None:
        """Make a checkpoint read by ``checkpoint.load`` the job, and say where it came from."""
        self._load(snapshot)
        assert snapshot.path is not None
        self.restored_from = snapshot.path.name
        self.checkpoints_skipped += len(snapshot.skipped)
        if snapshot.skipped:
            event(log, logging.WARNING, "restored an older checkpoint: the newer ones are not complete",
                  restored=str(snapshot.path), skipped=len(snapshot.skipped), step=self.step)  # fmt: skip
        log.info("restored checkpoint %d of %s (step %d)", self.version, snapshot.path.parent, self.step)

    def _load(self, snapshot: checkpoint.Snapshot) -> None:
        """Make ``snapshot`` this server's job (a checkpoint: its workers not live; a backup's
        state transfer: as they are on the primary, pending pushes included)."""
        state = snapshot.state
        config = JobConfig.from_json(json.dumps(state["config"]))
        shards = {key: _Shard(key, torch.nn.Parameter(snapshot.params[key]), state["versions"][key])
                  for key in state["shards"]}  # fmt: skip
        optimizer = config.optimizer.build(s.param for s in shards.values())
        optimizer.load_state_dict(checkpoint.optimizer_state(snapshot.optimizer, state["optimizer"]))
        self.config, self.shards, self.optimizer = config, shards, optimizer
        self._generation += 1
        self.world, self.step, self.version, self.pushes = (
            state["world"],
            state["step"],
            state["version"],
            state["pushes"],
        )
        self.workers = {int(w): _Worker(clock, False, clock, seq=seq, last_reply=bytes.fromhex(reply))
                        for w, (clock, seq, reply) in state["workers"].items()}  # fmt: skip
        for w, (live, read_clock, incarnation) in state.get("live", {}).items():
            worker = self.workers[int(w)]
            worker.live, worker.read_clock, worker.incarnation = live, read_clock, incarnation
        dropped = [b for b, _ in (g for p in self._pending.values() for g in p.grads.values())] + self._free
        self.budget.release("gradients", sum(map(_nbytes, dropped)))
        self._count_job()
        self._pending.clear()
        self._free.clear()
        keys = list(shards)
        for clock, by_worker in state.get("pending", {}).items():
            for w, present in by_worker.items():
                grads: _Grads = [None] * len(keys)
                for i in present:
                    grads[i] = snapshot.params[f"@pending/{clock}/{w}/{i}"]
                buffers: _Grads = [g if g is not None else torch.empty_like(shards[k].param.data)
                                   for g, k in zip(grads, keys, strict=True)]  # fmt: skip
                self._pending.setdefault(int(clock), _Pending()).grads[int(w)] = (buffers, grads)
                self.budget.add("gradients", _nbytes(buffers))  # the primary's, as it counted them

    # -- waiting --------------------------------------------------------------------------------
    async def _gate(self, head: wps.PsHead, state: _Worker) -> None:
        """Hold a worker's pull until its mode lets it read (see the module doc)."""
        mode = self.mode
        assert mode is not None
        if mode.kind == "sync":
            await self._wait(lambda: self.step >= head.clock, head, f"step {head.clock - 1} to be taken")
        elif mode.kind == "ssp":
            bound = mode.staleness
            await self._wait(
                lambda: head.clock - self.slowest() <= bound,
                head,
                f"the slowest worker to come within {bound} clocks of clock {head.clock}",
            )

    async def _wait(self, ready: Callable[[], bool], head: wps.PsHead, what: str) -> None:
        # The peer may ask for a shorter wait, never a longer one than the server's own.
        seconds = min(head.wait_ms / 1000, self.wait_timeout) if head.wait_ms else self.wait_timeout
        try:
            async with asyncio.timeout(seconds):
                while not ready():
                    if self._changed is None:
                        self._changed = asyncio.Event()
                    await self._changed.wait()
        except TimeoutError:
            raise WaitTimeout(f"waited {seconds:.3g}s for {what}; {self._who_lags()}") from None

    def _notify(self) -> None:
        """Wake every waiter to re-check what it waits for (one event per change, then a new one)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _who_lags(self) -> str:
        if self.config is None:
            return "no worker has initialised the job"
        live = sorted((w, s.clock) for w, s in self.workers.items() if s.live)
        clocks = ", ".join(f"worker {w} at clock {clock}" for w, clock in live[:16])
        missing = [w for w in range(min(self.world, len(self.workers) + 16)) if w not in self.workers][:16]
        joined = f"; never joined: {', '.join(map(str, missing))}" if missing else ""
        return f"step {self.step}, live: {clocks or 'none'}{joined}"

    # -- applying -------------------------------------------------------------------------------
    async def _apply_ready_steps(self) -> None:
        """Take every sync step whose gradients are all in (there may be several after a leave)."""
        async with self._step_lock():
            while (ready := self._ready_step()) is not None:
                del self._pending[self.step]
                mean = await self._run(_mean, [grads for _, grads in ready])
                await self._apply(mean, pushes=len(ready))
                self._free.extend(buffers for buffers, _ in ready)
                self.step += 1
                self._notify()
                await self._maybe_checkpoint()

    def _step_lock(self) -> asyncio.Lock:
        if self._applying is None:
            self._applying = asyncio.Lock()
        return self._applying

    def _ready_step(self) -> list[tuple[_Grads, _Grads]] | None:
        """The pushes of the current step in worker order, if every live worker pushed."""
        pending = self._pending.get(self.step)
        if pending is None or len(self.workers) < self.world:
            return None
        # Every live worker of this step pushed (one that joined for the next step is not in it).
        if any(w not in pending.grads for w in self.live() if self.workers[w].clock <= self.step):
            return None
        return [pending.grads[w] for w in sorted(pending.grads)]

    async def _apply(self, grads: _Grads, pushes: int) -> None:
        """One optimizer step with ``grads`` (one per shard, None where there is none)."""
        assert self.optimizer is not None
        shards = list(self.shards.values())
        async with self._lock.exclusive():
            await self._run(_step, self.optimizer, [s.param for s in shards], grads)
        self.version += 1
        self.pushes += pushes
        for shard, grad in zip(shards, grads, strict=True):
            if grad is not None:
                shard.version = self.version

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- checks ---------------------------------------------------------------------------------
    def _note_world(self, world: int) -> None:
        self.world = max(self.world, world)

    def _check_worker(self, head: wps.PsHead) -> None:
        if head.worker == wps.OBSERVER:
            raise ProtocolError("an observer cannot join or create a job")
        if not 0 < head.world <= MAX_WORLD or head.worker >= head.world:
            raise ProtocolError(f"worker {head.worker} of a world of {head.world} is not a valid rank")
        if self.world and head.world != self.world:
            raise ProtocolError(
                f"worker {head.worker} says the world has {head.world} workers; it has {self.world}"
            )

    def _check_same_job(self, config: JobConfig, metas: Sequence[TensorMeta]) -> None:
        """ProtocolError naming every difference between the job here and the one a worker runs
        (until jobs are first-class, a server holds one job: a second one needs its own servers)."""
        assert self.config is not None
        diffs = self.config.differences(config) + self._shard_differences(metas)
        if diffs:
            self.jobs_refused += 1
            said = "; ".join(diffs[:8])
            event(log, logging.WARNING, "a worker of another job was refused", differences=said)
            raise ProtocolError(
                f"this job runs {self._describe()}; a worker asked for another job: {said} "
                "(a second job needs parameter servers of its own)"
            )

    def _shard_differences(self, metas: Sequence[TensorMeta]) -> list[str]:
        """How a worker's shards (its model, placed over the servers) differ from this job's."""
        mine = {s.key: (s.param.dtype, s.param.numel()) for s in self.shards.values()}
        theirs = {m.name: (m.dtype, m.numel) for m in metas}
        diffs = []
        if extra := [k for k in theirs if k not in mine]:
            diffs.append(f"shard(s) {_few(extra)} of the worker's model are not in this job")
        if missing := [k for k in mine if k not in theirs]:
            diffs.append(f"this job's shard(s) {_few(missing)} are not in the worker's model")
        for key in [k for k in mine if k in theirs and mine[k] != theirs[k]][:4]:
            (dtype, n), (other, m) = mine[key], theirs[key]
            diffs.append(f"shard {key[:60]!r} is {n} x {dtype} here, {m} x {other} asked")
        return diffs

    def _describe(self) -> str:
        return self.config.to_json() if self.config else "nothing yet"

    def _member(self, request: Request, head: wps.PsHead, incarnation: int) -> _Worker:
        """The live worker sending ``head``, checked to be the session that joined with that rank
        (``incarnation``) before anything changes; WorkerDropped (rejoin) if it is not one."""
        state = self.workers.get(head.worker)
        if state is None or not state.live:
            why = (
                "it left or was dropped"
                if state is not None
                else "it has not joined since this server started"
            )
            raise WorkerDropped(f"worker {head.worker} is not part of this job ({why}): rejoin")
        if incarnation != state.incarnation:
            self._refuse_identity(request, head, incarnation)
        state.heard = time.monotonic()
        return state

    def _refuse_identity(self, request: Request, head: wps.PsHead, incarnation: int) -> None:
        """A request under a rank that another session (worker process) joined with: a second
        process with the same RANK, an old one that was replaced, or a forgery. Refused, counted,
        logged (the first time and then at every power of two, so a flood does not flood the log)."""
        self.identity_refused += 1
        what = Opcode(request.header.opcode).name
        if self.identity_refused & (self.identity_refused - 1) == 0:
            event(log, logging.WARNING, "refused a request under a rank another session holds", request=what,
                  worker=head.worker, peer=request.peer, refused_so_far=self.identity_refused)  # fmt: skip
        if not incarnation:
            raise ProtocolError(
                f"{what} as worker {head.worker} carries no incarnation (the session that joined "
                "with that rank): a worker older than this server? Use the same tensorwire on both"
            )
        raise WorkerDropped(
            f"{what} as worker {head.worker} refused: that rank belongs to another session (a worker "
            "process that joined with it); this one is not part of the job: rejoin"
        )

    def _check_push(self, head: wps.PsHead, state: _Worker) -> None:
        if self.config is None:
            raise ProtocolError("PS_PUSH before the job was initialised (PS_INIT)")
        if head.seq != state.seq + 1:
            raise ProtocolError(f"worker {head.worker} sent push {head.seq} after push {state.seq}")
        if head.clock != state.clock:
            raise ProtocolError(
                f"worker {head.worker} pushed for clock {head.clock}; it is at clock {state.clock}"
            )
        mode = self.config.mode
        if mode.kind == "ssp" and head.clock - state.read_clock > mode.staleness:
            raise ProtocolError(
                f"worker {head.worker} pushed for clock {head.clock} on parameters read at clock "
                f"{state.read_clock}: staler than {mode} allows (pull first)"
            )
        if mode.kind == "sync" and head.clock != self.step:
            # Behind: that step is taken. Ahead: it never pulled the step before (and gradients
            # held for future steps would pile up without bound).
            raise ProtocolError(f"worker {head.worker} pushed for step {head.clock}; the server is at step "
                                f"{self.step} (pull before pushing again)")  # fmt: skip

    def _shard(self, name: str) -> _Shard:
        shard = self.shards.get(name)
        if shard is None:
            raise ProtocolError(f"this server holds no shard {name!r}")
        return shard

    def _shards_for(
        self, metas: Sequence[TensorMeta], data_len: int, codec: Codec | None = None
    ) -> tuple[list[_Shard], list[bool]]:
        """A push carries one record for each shard here, in the shards' order: its gradient, or
        an empty one (``shape (0,)``) where the worker has no gradient (a parameter it did not use,
        which torch.optim would skip). Returns the shards and which of them have a gradient.
        With a codec the records describe the gradients as decoded, and the data holds payloads."""
        _check_records(metas, data_len if codec is None else None)
        if codec is not None and payload_total(codec, (m.numel for m in metas if m.nbytes)) != data_len:
            raise InvalidTensor(f"the {codec.name} payloads of the records do not add up to the frame's data")
        shards = list(self.shards.values())
        if [m.name for m in metas] != [s.key for s in shards]:
            raise ProtocolError("a push must carry a record for every shard of this server, in its order")
        present = []
        for meta, shard in zip(metas, shards, strict=True):
            if meta.dtype != shard.param.dtype:
                raise InvalidTensor(
                    f"gradient {meta.name!r} is {meta.dtype}; the shard is {shard.param.dtype}"
                )
            if meta.nbytes not in (0, shard.meta.nbytes):
                raise InvalidTensor(
                    f"gradient {meta.name!r} has {meta.nbytes} bytes; the shard {shard.meta.nbytes}"
                )
            present.append(meta.nbytes == shard.meta.nbytes)
        return shards, present

    def _take_buffers(self, shards: Sequence[_Shard]) -> _Grads:
        """A set of gradient buffers for a push: a free one of the current shards, or a new one
        counted against the capacity first (CapacityExceeded, nothing changed, if it cannot be)."""
        like = [(s.param.numel(), s.param.dtype) for s in shards]
        while self._free:
            buffers = self._free.pop()
            if [(b.numel(), b.dtype) for b in buffers if b is not None] == like:
                return buffers
            self.budget.release("gradients", _nbytes(buffers))  # of shards since replaced
        nbytes = sum(s.meta.nbytes for s in shards)
        self._make_room(nbytes)
        self.budget.reserve("gradients", nbytes, "a push's gradient buffers")
        fresh: _Grads = [torch.empty_like(s.param.data) for s in shards]
        return fresh

    def _make_room(self, nbytes: int) -> None:
        """Let go of free gradient buffers (kept only to save page faults) while ``nbytes`` more do
        not fit in the capacity."""
        while self._free and not self.budget.fits(nbytes):
            self.budget.release("gradients", _nbytes(self._free.pop()))

    def _record(self, staleness: int) -> None:
        self.staleness[min(staleness, MAX_STALENESS_BUCKET)] += 1


def _few(names: Sequence[str]) -> str:
    """A few of ``names``, for an error message (a peer chose them: bounded)."""
    shown = ", ".join(repr(name[:60]) for name in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _nbytes(tensors: Sequence[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _check_records(metas: Sequence[TensorMeta], data_len: int | None) -> None:
    if data_len is not None and sum(m.nbytes for m in metas) != data_len:
        raise InvalidTensor("the records' sizes do not add up to the frame's data length")
    for meta in metas:
        if len(meta.shape) != 1 or not meta.dtype.is_floating_point:
            raise InvalidTensor(f"shard {meta.name!r} must be a flat floating-point range")


def _check_replicated(metas: Sequence[TensorMeta], data_len: int, capacity: int) -> None:
    """A replicated job's values: as a worker's PS_INIT is checked, before a byte is allocated."""
    _check_records(metas, data_len)
    if data_len > capacity:
        raise CapacityExceeded(f"{data_len} bytes of parameters exceed {capacity}")


def _mean(pushes: Sequence[_Grads]) -> _Grads:
    """Per shard, the sum of the workers' gradients in worker order (into the first one's buffer),
    divided by the number of workers: a worker without a gradient for a shard counts as zeros,
    as in one process whose batch is all the workers' batches. None where nobody had one."""
    mean: _Grads = []
    for column in zip(*pushes, strict=True):
        present = [g for g in column if g is not None]
        if not present:
            mean.append(None)
            continue
        total = present[0]
        for grad in present[1:]:
            total.add_(grad)
        if len(pushes) > 1:
            total.div_(len(pushes))
        mean.append(total)
    return mean


def _encode_all(codec: Codec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: codec.encode(tensor) for key, tensor in tensors.items()}


def _copy_shards(snapshot: _Snapshot, shards: Mapping[str, _Shard]) -> None:
    for key, shard in shards.items():
        snapshot.tensors[key].copy_(shard.param.data)


def _step(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], grads: _Grads) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad  # None: torch.optim leaves the parameter (and its state) alone
    optimizer.step()
    for param in params:
        param.grad = None
