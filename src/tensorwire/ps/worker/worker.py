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
(``ps/worker/relay_reader.py``; a pull the relay cannot serve falls back to a direct one, with a warning,
counted in ``worker.relay.fallbacks``). It takes tcp:// or tls:// servers, a CPU model and no
``pull_codec``: anything else is refused (ValueError) when the worker is made.

Which job, who owns it, where the servers are, the rank and the world size: ``config.py``. ``barrier()``
returns once every live worker of the job has called it as often.

A model on a CUDA device trains as a CPU one does (the servers keep CPU tensors): its gradients
go device -> pinned host memory -> wire, the copy of each piece overlapping the send of the one
before; pulled parameters go wire -> pinned -> device, in place, on a side stream that the training
thread's stream waits for (an event, not a synchronize); codecs and error feedback run on the
device (``ps/worker/device.py``). It holds one pinned copy of the model's bytes.

A server on this worker's host that also serves ``shm://`` (``serve --listen shm://127.0.0.1:0``)
is reached through that listener (``prefer_local``, on by default; HELLO says where a server runs;
if shm:// fails the connection stays as given, with a warning). ``prefer_local=False`` keeps the
URLs as given. Parameter-server requests travel inline in frames either way: what it saves is the
network stack of a tcp:// connection to a server on another interface.

Every wait is bounded by ``timeout``: a pull that waits for the other workers' step gets the
server's TIMEOUT error, naming the workers it waited for.

This module holds the worker's training side: the order of pushes and pulls, and barriers. Its
parts: ``config`` (``WorkerConfig``: the arguments and the environment, resolved once),
``session`` (``WorkerSession``: joining, rejoining, heartbeats, leaving), ``slot``
(``ServerSlot``, one record per server: its replicas and connection, this worker's clock and
pushes there, and the reconnect-and-failover loop every request goes through), ``rpc``
(``PsChannel``: each parameter-server request, built and decoded in one place), ``shards``
(``ModelShards``: the tensors a push sends and a pull lands in) and ``rendezvous`` (where the
servers are, the rank and the world size).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

import torch

from tensorwire._aio import LoopThread, wait
from tensorwire.compression import Codec, ErrorFeedback
from tensorwire.coordinator import Coordinator, open_coordinator
from tensorwire.errors import ProtocolError, TensorwireError, WorkerDropped
from tensorwire.ps.job import Mode
from tensorwire.ps.optim import OptimizerSpec
from tensorwire.ps.placement import ParamSpec, Placement, plan
from tensorwire.ps.worker.config import MARGIN, WorkerConfig
from tensorwire.ps.worker.device import DeviceStaging
from tensorwire.ps.worker.leaders import COORDINATOR_ENV, LeaderWatch
from tensorwire.ps.worker.relay_reader import RelayPulls
from tensorwire.ps.worker.rendezvous import JOB_ENV, find_job
from tensorwire.ps.worker.rpc import Sender
from tensorwire.ps.worker.session import WorkerSession
from tensorwire.ps.worker.shards import ModelShards, check_params
from tensorwire.ps.worker.slot import ServerSlot
from tensorwire.security import TlsFiles
from tensorwire.wire import ps as wps

__all__ = ["PushResult", "Worker", "pull_parameters"]

T = TypeVar("T")


@dataclass(frozen=True)
class PushResult:
    """What the servers said of one push."""

    clock: int  # the clock the push was for
    version: int  # the highest version among the servers after it (sync: before the step)
    staleness: int  # the largest staleness a server recorded for it
    rejoined: bool = False  # a server had dropped this worker: it rejoined, and this push was lost


class _Setting(Generic[T]):
    """A read-only attribute of a ``Worker``: its ``config``'s field of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, worker: None, owner: type) -> _Setting[T]: ...
    @overload
    def __get__(self, worker: Worker, owner: type) -> T: ...
    def __get__(self, worker: Worker | None, owner: type) -> T | _Setting[T]:
        if worker is None:  # on the class: the descriptor itself (help(), documentation tools)
            return self
        value: T = getattr(worker.config, self.name)
        return value


class Worker:
    """One data-parallel worker of a parameter-server job (see the module doc).

    Its arguments, less ``model``, ``staging`` and ``coordinator``, are ``WorkerConfig.resolve``'s:
    the resolved settings are ``worker.config``, and the most read of them are also attributes
    (``rank``, ``world_size``, ``job``, ``servers``, ``mode``, ...). ``coordinator``: where the
    servers' leadership is decided (``etcd://...``, or an opened ``Coordinator`` with credentials;
    default ``$TENSORWIRE_COORDINATOR``): the worker watches each replica set's primary there
    (ps/worker/leaders.py) and moves to a new one at once.
    """

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
        coordinator: str | Coordinator | None = None,
    ) -> None:
        self.model = model
        self._params = check_params(model)
        self.config = config = WorkerConfig.resolve(
            self._params, servers, mode, optimizer, rank=rank, world_size=world_size, timeout=timeout,
            connect_timeout=connect_timeout, split_bytes=split_bytes, token=token, tls=tls,
            observer=observer, heartbeat=heartbeat, push_codec=push_codec, pull_codec=pull_codec,
            error_feedback=error_feedback, job=job, prefer_local=prefer_local, pull=pull,
            job_token=job_token,
        )  # fmt: skip
        codec = config.push_codec
        self.feedback = ErrorFeedback(codec) if config.error_feedback and codec is not None else None
        self.placement: Placement = plan(ParamSpec.of(model), len(config.servers), config.split_bytes)
        # A CUDA model's tensors go through pinned staging (ps/worker/device.py); ``staging``
        # replaces the device's own (tests stand a host copier in for the device).
        self._tensors = ModelShards(
            self._params, self.placement, codec, config.pull_codec, self.feedback, staging=staging
        )
        self.version = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self._options = config.options  # ``transports`` says which way each connection took
        self._slots = self._make_slots()  # one per server: everything this worker keeps of it
        self._session = WorkerSession(config, self._slots, self._tensors, self._pull_all)
        self.relay = self._relay_pulls()  # pull="relay": through the servers' relays
        self.leaders = self._leader_watch(coordinator)  # the coordinator's word on each primary
        self._pending: concurrent.futures.Future[PushResult] | None = None
        self._thread: LoopThread | None = None

    def _relay_pulls(self) -> RelayPulls | None:
        """``pull="relay"`` (checked by ``WorkerConfig``): the relay pulls (ps/worker/relay_reader.py);
        ValueError for a CUDA model (its pulls land in pinned staging)."""
        if not self.config.relay:
            return None
        if self._tensors.staging is not None:
            raise ValueError("pull='relay' lands in CPU parameters: a CUDA model pulls directly")
        return RelayPulls(self.job, self._options, self._params, exact=self.mode.kind == "sync",
                          stall_timeout=min(10.0, self.timeout))  # fmt: skip

    def _leader_watch(self, coordinator: str | Coordinator | None) -> LeaderWatch | None:
        """``coordinator`` (or ``$TENSORWIRE_COORDINATOR``): a URL, or a ``Coordinator`` opened
        with credentials (``open_coordinator(url, tls=..., user=..., password=...)``)."""
        chosen = coordinator if coordinator is not None else os.environ.get(COORDINATOR_ENV) or None
        if chosen is None:
            return None
        if isinstance(chosen, str):
            chosen = open_coordinator(chosen, timeout=min(self.config.connect_timeout, 5.0))
        return LeaderWatch(chosen, self._slots)

    def _make_slots(self) -> list[ServerSlot]:
        config = self.config
        worker = wps.OBSERVER if config.observer else config.rank
        sender = Sender(worker, config.world_size, int(config.timeout * 1000), config.job, config.job_token)
        return [
            ServerSlot(name, self.placement.on_server(i), rank=config.rank, sender=sender,
                       options=self._options, timeout=config.timeout)
            for i, name in enumerate(config.servers)
        ]  # fmt: skip

    # -- what the config and the session say ----------------------------------------------------
    job = _Setting[str]()
    mode = _Setting[Mode]()
    optimizer = _Setting[OptimizerSpec]()
    rank = _Setting[int]()
    world_size = _Setting[int]()
    timeout = _Setting[float]()
    connect_timeout = _Setting[float]()
    observer = _Setting[bool]()
    heartbeat = _Setting[float]()
    push_codec = _Setting["Codec | None"]()
    pull_codec = _Setting["Codec | None"]()

    @property
    def servers(self) -> list[str]:
        return list(self.config.servers)

    @property
    def incarnation(self) -> int:
        """This process's session secret (``WorkerSession``): never logged, never shown."""
        return self._session.incarnation

    @property
    def clock(self) -> int:
        """Pushes made since the last (re)join."""
        return self._session.clock

    @property
    def barriers(self) -> int:
        """The last barrier generation this worker passed."""
        return self._session.barriers

    @property
    def rejoins(self) -> int:
        return self._session.rejoins

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
                    wait(self._pending, self.timeout + MARGIN, "the last push")
            thread.call(self._leave(), self.connect_timeout + MARGIN, "leaving the job")
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
        clock = self._session.clock
        self._session.clock += 1
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
        passed: int = self._loop().call(self._barrier(wait), wait + 2 * MARGIN, "a barrier")
        return passed

    # -- joining and leaving: the session's ---------------------------------------------------
    async def _start(self) -> None:
        if self.observer:
            await self._pull_all()
            return
        await self._session.start()
        if self.leaders is not None:
            await self.leaders.start()
        self.version = await self._pull()

    async def _leave(self) -> None:
        await self._session.stop_heartbeats()
        if self.leaders is not None:
            await self.leaders.close()
        if self.relay is not None:
            await self.relay.close()
        await self._session.leave()

    # -- pulls and pushes -----------------------------------------------------------------------
    async def _pull(self) -> int:
        """Pull from every server; rejoin first if one of them dropped this worker."""
        try:
            return await self._pull_all()
        except WorkerDropped:
            self.version = await self._session.recover()
            return self.version

    async def _pull_all(self) -> int:
        versions = await _gather_all(self._pull_from(slot) for slot in self._serving())
        return max(versions, default=0)

    async def _pull_from(self, slot: ServerSlot) -> int:
        if self.relay is not None:
            relayed = await self.relay.pull(slot, slot.clock, self._sender_session())
            if relayed is not None:  # else a warning was logged: pull directly
                self.bytes_pulled += relayed[1]
                return relayed[0]
        into = await self._tensors.pull_into(slot.shards, slot.name)
        codec = self.pull_codec.name if self.pull_codec else None
        keys = [s.key for s in slot.shards]
        version = await slot.rpc.pull(slot.clock, self._sender_session(), keys, into.sink, codec)
        await into.finish()
        self.bytes_pulled += into.nbytes
        return version

    async def _push(
        self, grads: dict[str, torch.Tensor | None], payloads: dict[str, torch.Tensor], clock: int
    ) -> PushResult:
        try:
            replies = await _gather_all(self._push_to(slot, grads, payloads) for slot in self._serving())
        except WorkerDropped:
            # The push is lost: it was computed on parameters now gone.
            self.version = await self._session.recover()
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
                passed = await slot.rpc.barrier(self.barriers + 1, self.incarnation, wait)
                self._session.barriers = passed
                return passed
            except WorkerDropped:
                if attempt:
                    raise
                self.version = await self._session.recover()
        raise AssertionError("unreachable")

    async def _stats(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(slot.rpc.stats(slot.clock) for slot in self._serving())))

    # -- helpers --------------------------------------------------------------------------------
    def _sender_session(self) -> int:
        """What a request's ``seq`` says of who sends it: this process's incarnation, or 0 for an
        observer (which acts as no rank)."""
        return 0 if self.observer else self.incarnation

    def _serving(self) -> list[ServerSlot]:
        """The servers this worker talks to (``WorkerSession.serving``)."""
        return self._session.serving

    def _loop(self) -> LoopThread:
        if self._thread is None:
            raise ProtocolError("the worker is not started: use `with Worker(...)` or call start()")
        return self._thread

    def _call(self, coro: Any, what: str) -> Any:
        try:
            thread = self._loop()
        except BaseException:
            coro.close()  # never scheduled: the loop is missing
            raise
        # Scheduled from here on: the loop's task owns it (a close from this thread after a timeout
        # broke the task's cancellation: "cannot reuse already awaited coroutine").
        return thread.call(coro, self.timeout + 2 * MARGIN, what)

    def _finish_push(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            wait(pending, self.timeout + 2 * MARGIN, "the last push")


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
    (``ps serve --keep-jobs``): pull before then, or from servers that keep them."""
    job = job or os.environ.get(JOB_ENV) or find_job(model, servers, timeout=timeout, token=token, tls=tls)
    with Worker(
        model, servers, rank=0, world_size=1, timeout=timeout, token=token, tls=tls, observer=True, job=job
    ) as reader:
        return reader.version
