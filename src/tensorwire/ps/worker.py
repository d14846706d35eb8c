"""The worker side of the parameter server: ``Worker`` wraps a module for a training loop.

::

    with ps.Worker(model, servers=urls, mode="sync", optimizer=ps.Adam(lr=1e-3)) as worker:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            worker.step()  # in place of optimizer.step() and zero_grad()

Entering joins the job on every server, initialises the parameters there if no worker has yet
(the first worker's values win), and pulls them, so every worker starts from the same numbers.
Leaving (also on an exception) waits for the last push and leaves the job, so that the others stop
waiting for this worker: workers with uneven amounts of data finish cleanly.

* ``pull()`` writes the parameters into the module's own tensors, in place (no copy: the bytes
  land in ``param.data``), from all servers at once.
* ``push()`` sends the ``.grad`` of every parameter to all servers at once and returns a future,
  so the caller can go on (load the next batch) while it travels. The gradients are handed over:
  the module's ``.grad`` are set to None, and the next ``backward()`` makes new ones, so a push in
  flight never sees them change.
* ``step()`` is ``push()`` then ``pull()``.

Compression (tensorwire.compression): ``push_codec="topk:0.01+fp16"`` (or ``int8``, ``fp16``,
``sign``, ...) sends each gradient shard in that codec, with error feedback on (the part a codec
drops is added to the next step's gradient; ``error_feedback=False`` turns it off). Error feedback
keeps one residual per parameter: one more copy of the gradients, the model's size again.
``pull_codec="int8"`` or ``"bf16"`` pulls the parameters quantised (the servers keep them, and
their optimizer state, in full precision); a lossy pull is for workers that tolerate it.

Pulls through the relay: ``pull="relay"`` (default ``"direct"``) has each server publish a new
version once and the job's workers read it through the relay, each forwarding verified chunks to
the next, so a server's link carries each version about once instead of once per worker
(``ps/relay_reader.py``; a pull the relay cannot serve falls back to a direct one, with a warning,
counted in ``worker.relay.fallbacks``). It takes tcp:// or tls:// servers, a CPU model and no
``pull_codec``: anything else is refused (ValueError) when the worker is made.

Which job: ``job=`` (an id: 1 to 64 letters, digits, ``.``, ``_``, ``-``), else ``$TENSORWIRE_JOB``,
else one derived from the model's parameter names, shapes and dtypes and the mode, so that a worker
of another model never joins a job silently. One set of servers runs several jobs at once; a
worker that names a job but runs another model, mode, optimizer or world is refused, naming the
difference. ``barrier()`` returns once every live worker of the job has called it as often.

Who owns the job: ``job_token=`` (a secret every worker of the job shares), else
``$TENSORWIRE_JOB_TOKEN``: the first worker's makes the job its own, and the servers refuse
(NotAuthorized) a worker that joins or initialises it with another or none, and a ``tensorwire ps
end`` without it (or the servers' operator token). ``tensorwire ps launch`` gives its workers
one. Without one the job is open: every client the servers admit may join or end it.

A model on a CUDA device trains as a CPU one does (the servers keep CPU tensors): its gradients
go device -> pinned host memory -> wire, the copy of each piece overlapping the send of the one
before; pulled parameters go wire -> pinned -> device, in place, on a side stream that the training
thread's stream waits for (an event, not a synchronize); codecs and error feedback run on the
device (``ps/device.py``). It holds one pinned copy of the model's bytes.

Where the servers are: ``servers=`` (URLs, or one comma-separated string), else
``$TENSORWIRE_SERVERS``, else (under ``torchrun``) what rank 0 published in torchrun's rendezvous
store. Rank and world size: ``rank=``/``world_size=``, else ``$RANK``/``$WORLD_SIZE`` (set by
torchrun and by ``tensorwire ps launch``), else 0 and 1.

A server on this worker's host that also serves ``shm://`` (``serve --listen shm://127.0.0.1:0``)
is reached through that listener (``prefer_local``, on by default; HELLO says where a server runs;
if shm:// fails the connection stays as given, with a warning). ``prefer_local=False`` keeps the
URLs as given. Parameter-server requests travel inline in frames either way: what it saves is the
network stack of a tcp:// connection to a server on another interface.

Every wait is bounded by ``timeout``: a pull that waits for the other workers' step gets the
server's TIMEOUT error, naming the workers it waited for.

This module holds the job's side of the worker (joining, rejoining, the order of pushes and
pulls). Its parts: ``slot`` (``ServerSlot``, one record per server: its replicas and connection,
this worker's clock and pushes there, and the reconnect-and-failover loop every request goes
through), ``rpc`` (``PsChannel``: each parameter-server request, built and decoded in one place),
``shards`` (``ModelShards``: the tensors a push sends and a pull lands in) and ``rendezvous``
(where the servers are, the rank and the world size).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import secrets
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import torch

from tensorwire import transport as transports
from tensorwire._aio import LoopThread, cancel_and_wait, wait
from tensorwire.compression import Codec, ErrorFeedback
from tensorwire.compression.codecs import resolve
from tensorwire.errors import ProtocolError, TensorwireError, WorkerDropped
from tensorwire.ps.device import DeviceStaging
from tensorwire.ps.job import JobConfig, Mode, default_job_id
from tensorwire.ps.optim import SGD, OptimizerSpec, spec_of
from tensorwire.ps.placement import ParamSpec, Placement, plan
from tensorwire.ps.relay_reader import RelayPulls, check_relay_servers
from tensorwire.ps.rendezvous import JOB_ENV, SERVERS_ENV, STORE_KEY, env_int, find_job, resolve_servers
from tensorwire.ps.rpc import JOB_TOKEN_ENV, Sender, server_stats
from tensorwire.ps.shards import ModelShards, check_params, check_trainable, model_digest
from tensorwire.ps.slot import RETRY_CAP, ServerSlot
from tensorwire.security import TlsFiles, client_security
from tensorwire.wire import ps as wps

__all__ = [
    "JOB_ENV",
    "JOB_TOKEN_ENV",
    "SERVERS_ENV",
    "STORE_KEY",
    "PushResult",
    "Worker",
    "check_trainable",
    "env_int",
    "find_job",
    "model_digest",
    "pull_parameters",
    "resolve_servers",
    "server_stats",
]

log = logging.getLogger("tensorwire.ps.worker")
T = TypeVar("T")
CATCH_UP_TRIES = 10  # joins that wait for servers a step behind before rolling them back
_MARGIN = 10.0  # a request's own timer runs this much longer than the server's wait, so the
# server's answer (naming who it waited for) arrives before the client gives up.


@dataclass(frozen=True)
class PushResult:
    """What the servers said of one push."""

    clock: int  # the clock the push was for
    version: int  # the highest version among the servers after it (sync: before the step)
    staleness: int  # the largest staleness a server recorded for it
    rejoined: bool = False  # a server had dropped this worker: it rejoined, and this push was lost


class Worker:
    """One data-parallel worker of a parameter-server job (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        servers: Sequence[str] | str | None = None,
        mode: str | Mode = "sync",
        optimizer: OptimizerSpec | torch.optim.Optimizer | str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        split_bytes: int | None = None,
        token: str | None = None,
        tls: TlsFiles | None = None,
        observer: bool = False,
        heartbeat: float = 1.0,
        push_codec: Codec | str | None = None,
        pull_codec: Codec | str | None = None,
        error_feedback: bool | None = None,
        job: str | None = None,
        staging: DeviceStaging | None = None,
        prefer_local: bool = True,
        pull: str = "direct",
        job_token: str | None = None,
    ) -> None:
        self.model = model
        self.mode = Mode.parse(mode)
        self.optimizer = spec_of(optimizer if optimizer is not None else SGD())
        self.rank = env_int("RANK", rank, 0)
        self.world_size = env_int("WORLD_SIZE", world_size, 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.observer = observer  # pulls only, without joining (evaluation, checkpoints)
        self.servers = resolve_servers(servers, self.rank, timeout)
        self._params = check_params(model)
        # The job: named, or derived from the model and the mode (another model: another job).
        named = job if job is not None else os.environ.get(JOB_ENV) or None  # an empty variable: unset
        self.job = wps.check_job_id(
            default_job_id(model_digest(self._params), self.mode) if named is None else named
        )
        # The job's token (a secret its workers share; see the module doc): never logged or shown.
        self._job_token = (job_token or os.environ.get(JOB_TOKEN_ENV) or "").encode()
        if len(self._job_token) > wps.MAX_CREDENTIAL_BYTES:
            raise ValueError(f"a job token is at most {wps.MAX_CREDENTIAL_BYTES} bytes")
        self.barriers = 0  # the last barrier generation this worker passed
        self.push_codec, self.pull_codec = resolve(push_codec), resolve(pull_codec)
        if self.pull_codec is not None and self.pull_codec.sparse:
            raise ValueError(f"pull_codec {self.pull_codec.name} drops elements: use int8, bf16 or fp16")
        if error_feedback is None:  # on by default wherever the codec loses something
            error_feedback = self.push_codec is not None and self.push_codec.lossy
        if error_feedback and self.push_codec is None:
            raise ValueError("error_feedback needs a push_codec")
        self.feedback = ErrorFeedback(self.push_codec) if error_feedback and self.push_codec else None
        self.placement: Placement = plan(ParamSpec.of(model), len(self.servers), split_bytes)
        # A CUDA model's tensors go through pinned staging (ps/device.py); ``staging`` replaces
        # the device's own (tests stand a host copier in for the device).
        self._tensors = ModelShards(
            self._params, self.placement, self.push_codec, self.pull_codec, self.feedback, staging=staging
        )
        # TLS files for tls:// servers (``TlsFiles(ca=...)`` for a private CA; a client certificate
        # where the servers require one) and the token (default: $TENSORWIRE_TOKEN).
        self._security = client_security(tls, token)
        self.heartbeat = heartbeat  # seconds between heartbeats (0: none); see ParamServer
        self.clock = 0  # pushes made since the last (re)join
        self.version = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.rejoins = 0
        # This process's session: the servers bind the rank to it at PS_JOIN, and every request that
        # acts as the rank carries it (a second process with the same RANK, or a forged request
        # under it, is refused). A secret of this process: never logged, never shown by a server.
        self.incarnation = secrets.randbits(63) or 1
        # A server on this host that serves shm:// is reached through it (prefer_local=False: as
        # given); ``transports`` says which each connection took.
        self._options = transports.TransportOptions(
            connect_timeout, timeout + _MARGIN, security=self._security, prefer_local=prefer_local
        )
        self._slots = self._make_slots()  # one per server: everything this worker keeps of it
        self.relay = self._relay_pulls(pull)  # pull="relay": through the servers' relays
        self._beating: asyncio.Task[None] | None = None
        self._pending: concurrent.futures.Future[PushResult] | None = None
        self._thread: LoopThread | None = None
        self._joined = False

    def _relay_pulls(self, pull: str) -> RelayPulls | None:
        """``pull="relay"``: the relay pulls (ps/relay_reader.py); ValueError for what cannot go
        through a relay: quantised pulls (the relay moves the parameters as the server keeps
        them), a CUDA model (its pulls land in pinned staging), servers not on tcp:// or tls://."""
        if pull == "direct":
            return None
        if pull != "relay":
            raise ValueError(f"pull must be 'direct' or 'relay', not {pull!r}")
        if self.pull_codec is not None:
            raise ValueError("pull='relay' moves full-precision parameters: it takes no pull_codec")
        if self._tensors.staging is not None:
            raise ValueError("pull='relay' lands in CPU parameters: a CUDA model pulls directly")
        check_relay_servers(self.servers)
        stall = min(10.0, self.timeout)
        return RelayPulls(self.job, self._options, self._params, exact=self.mode.kind == "sync",
                          stall_timeout=stall)  # fmt: skip

    def _make_slots(self) -> list[ServerSlot]:
        worker = wps.OBSERVER if self.observer else self.rank
        sender = Sender(worker, self.world_size, int(self.timeout * 1000), self.job, self._job_token)
        return [
            ServerSlot(name, self.placement.on_server(i), rank=self.rank, sender=sender,
                       options=self._options, timeout=self.timeout)
            for i, name in enumerate(self.servers)
        ]  # fmt: skip

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Worker:
        """Connect, join, initialise the job if nobody has, and pull the parameters."""
        if self._thread is not None:
            return self
        self._thread = LoopThread("tensorwire-worker")
        self._tensors.after_compute()  # a device model: its values are read, then overwritten
        try:
            self._call(self._start(), "joining the job")
        except BaseException:
            self.close()
            raise
        self._tensors.order_compute()
        return self

    def close(self) -> None:
        """Wait for the last push, leave the job (the others stop waiting for this worker)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            if self._pending is not None and not self._pending.done():
                with contextlib.suppress(TensorwireError, TimeoutError):
                    wait(self._pending, self.timeout + _MARGIN, "the last push")
            thread.call(self._leave(), self.connect_timeout + _MARGIN, "leaving the job")
        finally:
            thread.stop()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- training -------------------------------------------------------------------------------
    def pull(self) -> int:
        """Write the current parameters into the module in place; return the servers' version.

        Waits for this worker's last push first; in ``sync`` mode then for the step it completes,
        in ``ssp:s`` while this worker is more than s clocks ahead of the slowest.
        """
        self._finish_push()
        self._tensors.after_compute()  # the pull overwrites parameters the queued work may still read
        self.version = self._call(self._pull(), "a pull of the parameters")
        self._tensors.order_compute()  # a device model: this thread's stream waits for the copies
        return self.version

    def push(self) -> concurrent.futures.Future[PushResult]:
        """Send every parameter's gradient to its servers; the future settles when they have it."""
        if self.observer:
            raise ProtocolError("an observer worker does not push")
        self._finish_push()
        self._tensors.order_compute()  # a rejoin inside the last push may have pulled
        grads = self._tensors.take_grads()
        payloads = self._tensors.encode(grads)
        self._tensors.after_compute()  # a device model: its copies start after this backward
        clock, self.clock = self.clock, self.clock + 1
        self._pending = self._loop().submit(self._push(grads, payloads, clock))
        return self._pending

    def step(self) -> PushResult:
        """``push()``, then ``pull()``: one training step's exchange."""
        future = self.push()
        self.pull()
        return future.result()

    def stats(self) -> list[dict[str, Any]]:
        """Each server's view of the job (mode, step, workers' clocks, staleness histogram)."""
        stats: list[dict[str, Any]] = self._call(self._stats(), "the servers' stats")
        return stats

    def barrier(self, timeout: float | None = None) -> int:
        """Wait until every live worker of the job has called ``barrier()`` as often as this one
        (after this worker's last push is in); the generation passed. A worker that leaves or is
        dropped releases the others. ``timeout`` (default: the worker's): how long to wait; the
        server's TIMEOUT error then names the workers that have not arrived."""
        if self.observer:
            raise ProtocolError("an observer worker takes no part in barriers")
        self._finish_push()
        wait = self.timeout if timeout is None else timeout
        passed: int = self._loop().call(self._barrier(wait), wait + 2 * _MARGIN, "a barrier")
        return passed

    # -- joining --------------------------------------------------------------------------------
    async def _start(self) -> None:
        if self.observer:
            await self._pull_all()
            return
        if self.heartbeat > 0:  # beating from the start: a slow first pull must not get it dropped
            self._beating = asyncio.get_running_loop().create_task(self._heartbeats())
        await self._join_all(first=True)
        self.version = await self._pull()

    async def _join_all(self, first: bool = False) -> None:
        """Join on every server (initialising the job where there is none). In sync mode this
        worker must be at one step on all of them. Servers of a live job can be a step apart for a
        moment (each takes the step when its pushes are in): then it leaves those behind, lets them
        finish that step without it, and joins again. Servers restored from checkpoints written a
        step apart do not move by themselves: after a while they are rolled back to the older one,
        which each of them keeps."""
        config = JobConfig(self.mode, self.optimizer, model_digest(self._params)).to_json()
        slots = self._serving()
        clocks: list[int] = []
        for attempt in range(CATCH_UP_TRIES + 3):
            joined = await asyncio.gather(*(self._join(slot, config, first) for slot in slots))
            self._joined = True
            for slot, (clock, seq, _) in zip(slots, joined, strict=True):
                slot.joined(clock, seq)
            self.barriers = max(self.barriers, joined[0][2])  # barriers are kept by the first server
            clocks = [slot.clock for slot in slots]
            if self.mode.kind != "sync" or len(set(clocks)) == 1:
                self.clock = max(clocks)
                return
            behind = [slot for slot in slots if slot.clock < max(clocks)]
            if attempt < CATCH_UP_TRIES:
                leaving = (slot.rpc.leave(slot.clock, self.incarnation, final=False) for slot in behind)
                await asyncio.gather(*leaving)
                await asyncio.sleep(0.05 * (attempt + 1))
                continue
            target = min(clocks)
            log.warning("servers stay at steps %s: rolling back to step %d", clocks, target)
            ahead = [slot for slot in slots if slot.clock > target]
            # A server rolls back only with no worker live, and this one has just joined it.
            await asyncio.gather(
                *(slot.rpc.leave(slot.clock, self.incarnation, final=False) for slot in ahead)
            )
            await asyncio.gather(*(slot.rpc.rollback(target, self.incarnation) for slot in ahead))
        raise ProtocolError(f"the servers could not be brought to one step: {clocks}")

    async def _join(self, slot: ServerSlot, config: str, first: bool) -> tuple[int, int, int]:
        records = [self._tensors.meta(s) for s in slot.shards]
        for attempt in itertools.count(1):
            joined = await slot.rpc.join(slot.clock, self.incarnation, config, records)
            clock, initialized, seq, barrier = joined
            if not first and initialized:
                return clock, seq, barrier
            try:  # the first time, also to check that the server's job is this one
                await self._init(slot, config, with_values=not initialized)
                return clock, seq, barrier
            except WorkerDropped:  # the worker creating the job failed: try again, ours may win
                if attempt == 3:
                    raise
        raise AssertionError("unreachable")

    async def _init(self, slot: ServerSlot, config: str, with_values: bool) -> None:
        """Create the job with this worker's values (the first worker's win), or, without values,
        only check that the server's job is this one (same mode, optimizer and shards)."""
        records = [self._tensors.meta(s) for s in slot.shards]
        data = self._tensors.values(slot.shards) if with_values else []
        await slot.rpc.init(slot.clock, self.incarnation, config, records, data)

    async def _recover(self) -> None:
        """A server no longer counts this worker (it restarted, or dropped the worker after missed
        heartbeats): rejoin everywhere and pull the current parameters."""
        log.warning("worker %d was dropped by a server: rejoining", self.rank)
        self.rejoins += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            try:
                await self._join_all()
                self.version = await self._pull_all()
                return
            except WorkerDropped:  # dropped again meanwhile (a failover, a slow machine): once more
                if loop.time() >= deadline:
                    raise
                log.warning("worker %d was dropped again while rejoining: rejoining", self.rank)
                await asyncio.sleep(RETRY_CAP)

    # -- pulls and pushes -----------------------------------------------------------------------
    async def _pull(self) -> int:
        """Pull from every server; rejoin first if one of them dropped this worker."""
        try:
            return await self._pull_all()
        except WorkerDropped:
            await self._recover()
            return self.version

    async def _pull_all(self) -> int:
        versions = await _gather_all(self._pull_from(slot) for slot in self._serving())
        return max(versions, default=0)

    async def _pull_from(self, slot: ServerSlot) -> int:
        if self.relay is not None:
            relayed = await self.relay.pull(slot, slot.clock, self._session())
            if relayed is not None:  # else a warning was logged: pull directly
                self.bytes_pulled += relayed[1]
                return relayed[0]
        into = await self._tensors.pull_into(slot.shards, slot.name)
        codec = self.pull_codec.name if self.pull_codec else None
        keys = [s.key for s in slot.shards]
        version = await slot.rpc.pull(slot.clock, self._session(), keys, into.sink, codec)
        await into.finish()
        self.bytes_pulled += into.nbytes
        return version

    async def _push(
        self, grads: dict[str, torch.Tensor | None], payloads: dict[str, torch.Tensor], clock: int
    ) -> PushResult:
        try:
            replies = await _gather_all(self._push_to(slot, grads, payloads) for slot in self._serving())
        except WorkerDropped:
            await self._recover()  # the push is lost: it was computed on parameters now gone
            return PushResult(clock, self.version, 0, rejoined=True)
        versions, staleness = zip(*replies, strict=True) if replies else ((0,), (0,))
        return PushResult(clock, max(versions), max(staleness))

    async def _push_to(
        self,
        slot: ServerSlot,
        grads: dict[str, torch.Tensor | None],
        payloads: dict[str, torch.Tensor] | None = None,
    ) -> tuple[int, int]:
        """One push, exactly once: a resend after a broken connection carries the same sequence
        number (``ServerSlot.call``), and a server that applied it already only answers again."""
        metas, data = await self._tensors.push_data(slot.shards, grads, payloads, slot.name)
        seq = slot.seq + 1

        def acked() -> None:
            slot.acked(seq)
            self.bytes_pushed += sum(len(d) for d in data)

        codec = self.push_codec.name if self.push_codec else None
        return await slot.rpc.push(
            slot.clock, seq, metas, data, codec=codec, incarnation=self.incarnation, acked=acked
        )

    async def _barrier(self, wait: float) -> int:
        """The next barrier, on the job's first server (every worker places the same shards, so
        it is the same server for all of them); rejoin and ask again if it dropped this worker."""
        for attempt in range(2):
            slot = self._serving()[0]
            try:
                self.barriers = await slot.rpc.barrier(self.barriers + 1, self.incarnation, wait)
                return self.barriers
            except WorkerDropped:
                if attempt:
                    raise
                await self._recover()
        raise AssertionError("unreachable")

    async def _stats(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(slot.rpc.stats(slot.clock) for slot in self._serving())))

    # -- heartbeats and leaving -----------------------------------------------------------------
    async def _heartbeats(self) -> None:
        """Tell every server this worker is alive, each on a connection of its own (a pull waiting
        for a step must not hold up the heartbeat); a server that drops it is rejoined by the
        next push or pull."""
        wait = max(self.heartbeat * 4, 1.0)
        options = self._options._replace(connect_timeout=wait, request_timeout=wait)
        sender = Sender(self.rank, self.world_size, job=self.job)
        try:
            while True:
                await asyncio.gather(*(s.beat(sender, self.incarnation, options) for s in self._serving()))
                await asyncio.sleep(self.heartbeat)
        finally:
            for slot in self._slots:
                await slot.close_beat()

    async def _leave(self) -> None:
        """Leave every server that can be reached now (no retries: the process may be ending)."""
        await cancel_and_wait(self._beating)
        if self.relay is not None:
            await self.relay.close()
        try:
            if self._joined:
                sender = Sender(self.rank, self.world_size, job=self.job)
                leaving = (slot.leave(sender, self.incarnation, self.connect_timeout) for slot in self._slots)
                await asyncio.gather(*leaving, return_exceptions=True)
        finally:
            for slot in self._slots:
                await slot.close()

    # -- helpers --------------------------------------------------------------------------------
    def _session(self) -> int:
        """What a request's ``seq`` says of who sends it: this process's incarnation, or 0 for an
        observer (which acts as no rank)."""
        return 0 if self.observer else self.incarnation

    def _serving(self) -> list[ServerSlot]:
        """The servers this worker talks to: those the placement gives a shard (a model with
        fewer elements than there are servers leaves some without)."""
        return [slot for slot in self._slots if slot.shards]

    def _loop(self) -> LoopThread:
        if self._thread is None:
            raise ProtocolError("the worker is not started: use `with Worker(...)` or call start()")
        return self._thread

    def _call(self, coro: Any, what: str) -> Any:
        try:
            return self._loop().call(coro, self.timeout + 2 * _MARGIN, what)
        except BaseException:
            coro.close()  # never scheduled when the loop is missing
            raise

    def _finish_push(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            wait(pending, self.timeout + 2 * _MARGIN, "the last push")


async def _gather_all(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Like ``asyncio.gather``, but every call finishes before the first error is raised (a call
    still running after its sibling failed would change this worker's state behind its back)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


def pull_parameters(
    model: torch.nn.Module,
    servers: Sequence[str] | str,
    *,
    timeout: float = 60.0,
    token: str | None = None,
    tls: TlsFiles | None = None,
    job: str | None = None,
) -> int:
    """Write a job's current parameters into ``model`` without joining it (evaluation, export).
    The job: ``job``, else ``$TENSORWIRE_JOB``, else the one job on the servers whose model is
    ``model`` (``find_job``). A job ends when its last worker leaves, unless the servers keep jobs
    (``serve --keep-jobs``): pull before then, or from servers that keep them."""
    job = job or os.environ.get(JOB_ENV) or find_job(model, servers, timeout=timeout, token=token, tls=tls)
    with Worker(
        model, servers, rank=0, world_size=1, timeout=timeout, token=token, tls=tls, observer=True, job=job
    ) as reader:
        return reader.version
