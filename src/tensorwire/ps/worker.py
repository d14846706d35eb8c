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

Where the servers are: ``servers=`` (URLs, or one comma-separated string), else
``$TENSORWIRE_SERVERS``, else (under ``torchrun``) what rank 0 published in torchrun's rendezvous
store. Rank and world size: ``rank=``/``world_size=``, else ``$RANK``/``$WORLD_SIZE`` (set by
torchrun and by ``tensorwire ps launch``), else 0 and 1.

Every wait is bounded by ``timeout``: a pull that waits for the other workers' step gets the
server's TIMEOUT error, naming the workers it waited for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import logging
import os
import secrets
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

import torch

from tensorwire import transport as transports
from tensorwire._aio import LoopThread, wait
from tensorwire.compression import Codec, ErrorFeedback, decode_all, resolve
from tensorwire.errors import (
    ConnectError,
    ConnectionLost,
    InvalidTensor,
    NotPrimary,
    ProtocolError,
    TensorwireError,
    WorkerDropped,
)
from tensorwire.ps.job import JobConfig, Mode
from tensorwire.ps.optim import SGD, OptimizerSpec, spec_of
from tensorwire.ps.placement import ParamSpec, Placement, Shard, plan
from tensorwire.security import Security, TlsFiles, client_token
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view

log = logging.getLogger("tensorwire.ps.worker")
T = TypeVar("T")
SERVERS_ENV = "TENSORWIRE_SERVERS"
STORE_KEY = "tensorwire/servers"
RETRY_CAP = 0.25  # seconds between resends at most
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
        self._params = _check_params(model)
        self.push_codec, self.pull_codec = resolve(push_codec), resolve(pull_codec)
        if self.pull_codec is not None and self.pull_codec.sparse:
            raise ValueError(f"pull_codec {self.pull_codec.name} drops elements: use int8, bf16 or fp16")
        if error_feedback is None:  # on by default wherever the codec loses something
            error_feedback = self.push_codec is not None and self.push_codec.lossy
        if error_feedback and self.push_codec is None:
            raise ValueError("error_feedback needs a push_codec")
        self.feedback = ErrorFeedback(self.push_codec) if error_feedback and self.push_codec else None
        self._pull_buffers: dict[str, torch.Tensor] = {}  # a compressed pull lands here first
        self.placement: Placement = plan(ParamSpec.of(model), len(self.servers), split_bytes)
        self._shards = [self.placement.on_server(i) for i in range(len(self.servers))]
        # TLS files for tls:// servers (``TlsFiles(ca=...)`` for a private CA; a client certificate
        # where the servers require one) and the token (default: $TENSORWIRE_TOKEN).
        self._security = Security(tls, client_token(token))
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
        self._options = transports.TransportOptions(
            connect_timeout, timeout + _MARGIN, security=self._security
        )
        self._conns: list[FramedTransport | None] = [None] * len(self.servers)
        # Each server may be a replica set, "tcp://a:1|tcp://b:2": requests go to the one that
        # answers as primary, and move on when it breaks or says NOT_PRIMARY.
        self._replicas = [slot.split("|") for slot in self.servers]
        self._at = [0] * len(self.servers)
        self._reconnecting = [asyncio.Lock() for _ in self.servers]
        self._clocks = [0] * len(self.servers)  # this worker's clock on each server
        self._seqs = [0] * len(self.servers)  # the last push sequence number each server applied
        self._beating: asyncio.Task[None] | None = None
        self._pending: concurrent.futures.Future[PushResult] | None = None
        self._thread: LoopThread | None = None
        self._joined = False

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Worker:
        """Connect, join, initialise the job if nobody has, and pull the parameters."""
        if self._thread is not None:
            return self
        self._thread = LoopThread("tensorwire-worker")
        try:
            self._call(self._start(), "joining the job")
        except BaseException:
            self.close()
            raise
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
        self.version = self._call(self._pull(), "a pull of the parameters")
        return self.version

    def push(self) -> concurrent.futures.Future[PushResult]:
        """Send every parameter's gradient to its servers; the future settles when they have it."""
        if self.observer:
            raise ProtocolError("an observer worker does not push")
        self._finish_push()
        grads = self._take_grads()
        payloads = self._encode(grads)
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

    # -- the async side -------------------------------------------------------------------------
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
        servers = self._servers()
        clocks: list[int] = []
        for attempt in range(CATCH_UP_TRIES + 3):
            joined = await asyncio.gather(*(self._join(i, config, first) for i in servers))
            self._joined = True
            for i, (clock, seq) in zip(servers, joined, strict=True):
                self._clocks[i], self._seqs[i] = clock, seq
            clocks = [self._clocks[i] for i in servers]
            if self.mode.kind != "sync" or len(set(clocks)) == 1:
                self.clock = max(clocks)
                return
            behind = [i for i in servers if self._clocks[i] < max(clocks)]
            if attempt < CATCH_UP_TRIES:
                leaving = (self._request(i, Opcode.PS_LEAVE, b"", seq=self.incarnation) for i in behind)
                await asyncio.gather(*leaving)
                await asyncio.sleep(0.05 * (attempt + 1))
                continue
            target = min(clocks)
            log.warning("servers stay at steps %s: rolling back to step %d", clocks, target)
            await asyncio.gather(*(self._rollback(i, target) for i in servers if self._clocks[i] > target))
        raise ProtocolError(f"the servers could not be brought to one step: {clocks}")

    async def _join(self, server: int, config: str, first: bool) -> tuple[int, int]:
        # The job as this worker sees it: a server running another one refuses before admitting it.
        job = wps.encode_config(config) + wm.encode_records([self._meta(s) for s in self._shards[server]])
        for attempt in itertools.count(1):
            reader = await self._request(server, Opcode.PS_JOIN, job, seq=self.incarnation)
            clock, initialized, seq = wps.decode_join_reply(reader)
            reader.done()
            if not first and initialized:
                return clock, seq
            try:  # the first time, also to check that the server's job is this one
                await self._init(server, config, with_values=not initialized)
                return clock, seq
            except WorkerDropped:  # the worker creating the job failed: try again, ours may win
                if attempt == 3:
                    raise
        raise AssertionError("unreachable")

    async def _rollback(self, server: int, version: int) -> None:
        reader = await self._request(server, Opcode.PS_ROLLBACK, b"", clock=version)
        wps.decode_u64(reader)
        reader.done()

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

    async def _open(self, url: str, options: transports.TransportOptions) -> FramedTransport:
        address = Address.parse(url)
        conn = await transports.open_transport(address, options)
        if not isinstance(conn, FramedTransport):
            await conn.close()
            raise ValueError(f"parameter servers speak tcp://, tls:// or memory://, not {address.scheme}://")
        return conn

    async def _connection(self, server: int) -> FramedTransport:
        conn = self._conns[server]
        if conn is not None and not conn.closed:
            return conn
        async with self._reconnecting[server]:
            conn = self._conns[server]
            if conn is None or conn.closed:
                conn = self._conns[server] = await self._open(self._url(server), self._options)
            return conn

    def _url(self, server: int) -> str:
        return self._replicas[server][self._at[server]]

    async def _next_replica(self, server: int) -> None:
        """Move to the server's next replica (a failover), if it has several."""
        if len(self._replicas[server]) < 2:
            return
        conn, self._conns[server] = self._conns[server], None
        if conn is not None:
            await conn.close()
        self._at[server] = (self._at[server] + 1) % len(self._replicas[server])
        log.info("worker %d moves to replica %s", self.rank, self._url(server))

    async def _init(self, server: int, config: str, with_values: bool) -> None:
        """Create the job with this worker's values (the first worker's win), or, without values,
        only check that the server's job is this one (same mode, optimizer and shards)."""
        shards = self._shards[server]
        metas = [self._meta(s) for s in shards]
        data = [byte_view(self._view(self._params[s.param].data, s)) for s in shards] if with_values else []
        meta = wps.encode_config(config) + wm.encode_records(metas)
        reader = await self._request(server, Opcode.PS_INIT, meta, data)
        wps.decode_init_reply(reader)
        reader.done()

    async def _pull(self) -> int:
        """Pull from every server; rejoin first if one of them dropped this worker."""
        try:
            return await self._pull_all()
        except WorkerDropped:
            await self._recover()
            return self.version

    async def _pull_all(self) -> int:
        versions = await _gather_all(self._pull_from(i) for i in self._servers())
        return max(versions, default=0)

    async def _pull_from(self, server: int) -> int:
        shards = self._shards[server]
        expected = [m[:4] for m in map(self._meta, shards)]  # all but the version

        def land(metas: list[TensorMeta]) -> list[memoryview]:
            if [m[:4] for m in metas] != expected:
                raise ProtocolError(f"{self.servers[server]} answered a pull with other shards than asked")
            return [byte_view(self._view(self._params[s.param].data, s)) for s in shards]

        codec = self.pull_codec
        if codec is not None:
            return await self._pull_encoded(server, codec)
        names = wm.encode_names([s.key for s in shards])
        reader = await self._request(server, Opcode.PS_PULL, names, sink=land, seq=self._session())
        self.bytes_pulled += sum(m[3] for m in expected)
        version = wps.decode_u64(reader)
        reader.done()
        return version

    async def _pull_encoded(self, server: int, codec: Codec) -> int:
        """A pull in ``pull_codec``: the payloads land in buffers kept per shard, then are decoded
        into the parameters in place."""
        shards = self._shards[server]
        payloads = [self._pull_buffer(s.key, codec.payload_bytes(s.numel)) for s in shards]
        expected = [(s.key, torch.uint8, (p.numel(),)) for s, p in zip(shards, payloads, strict=True)]

        def land(metas: list[TensorMeta]) -> list[memoryview]:  # records of the payloads, as uint8
            if [m[:3] for m in metas] != expected:
                raise ProtocolError(f"{self.servers[server]} answered a pull with other shards than asked")
            return [byte_view(p) for p in payloads]

        names = wm.encode_names([s.key for s in shards]) + wps.encode_codec(codec.name)
        reader = await self._request(server, Opcode.PS_PULL, names, sink=land, seq=self._session())
        version = wps.decode_u64(reader)
        if wps.decode_codec(reader) != codec.name:
            raise ProtocolError(f"{self.servers[server]} answered a {codec.name} pull in another codec")
        reader.done()
        params = [self._view(self._params[s.param].data, s) for s in shards]
        decode_all(codec, payloads, params)
        self.bytes_pulled += sum(p.numel() for p in payloads)
        return version

    def _pull_buffer(self, key: str, nbytes: int) -> torch.Tensor:
        buffer = self._pull_buffers.get(key)
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._pull_buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer

    def _encode(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Each shard's gradient in ``push_codec`` (none without one), through error feedback
        when it is on; done here, in the caller's thread, before the push goes out."""
        codec = self.push_codec
        if codec is None:
            return {}
        payloads = {}
        for shard in self.placement.shards:
            grad = grads[shard.param]
            if grad is None:
                continue  # its residual waits for the next gradient
            view = self._view(grad, shard)
            payloads[shard.key] = (
                self.feedback.encode(shard.key, view) if self.feedback else codec.encode(view)
            )
        return payloads

    async def _push(
        self, grads: dict[str, torch.Tensor | None], payloads: dict[str, torch.Tensor], clock: int
    ) -> PushResult:
        try:
            replies = await _gather_all(self._push_to(i, grads, payloads) for i in self._servers())
        except WorkerDropped:
            await self._recover()  # the push is lost: it was computed on parameters now gone
            return PushResult(clock, self.version, 0, rejoined=True)
        versions, staleness = zip(*replies, strict=True) if replies else ((0,), (0,))
        return PushResult(clock, max(versions), max(staleness))

    async def _push_to(
        self,
        server: int,
        grads: dict[str, torch.Tensor | None],
        payloads: dict[str, torch.Tensor] | None = None,
    ) -> tuple[int, int]:
        """One push, exactly once: a resend after a broken connection carries the same sequence
        number, and a server that applied it already only answers again. A parameter without a
        gradient travels as an empty record. With a codec the records still describe the
        gradients; the data is their payloads."""
        shards = self._shards[server]
        metas, data = [], []
        for shard in shards:
            grad = grads[shard.param]
            if grad is None:
                metas.append(TensorMeta(shard.key, self._params[shard.param].dtype, (0,), 0))
            else:
                metas.append(self._meta(shard))
                payload = payloads.get(shard.key) if payloads else None
                data.append(byte_view(self._view(grad, shard) if payload is None else payload))
        seq = self._seqs[server] + 1
        codec = self.push_codec.name if self.push_codec else None
        body = wm.encode_records(metas) + wps.encode_push_tail(codec, self.incarnation)
        reader = await self._request(server, Opcode.PS_PUSH, body, data, clock=self._clocks[server], seq=seq)
        self._seqs[server] = seq
        self._clocks[server] += 1
        self.bytes_pushed += sum(len(d) for d in data)
        reply = wps.decode_push_reply(reader)
        reader.done()
        return reply

    async def _stats(self) -> list[dict[str, Any]]:
        readers = await asyncio.gather(*(self._request(i, Opcode.PS_STATS, b"") for i in self._servers()))
        docs: list[dict[str, Any]] = [json.loads(wps.decode_stats(r)) for r in readers]
        return docs

    async def _heartbeats(self) -> None:
        """Tell every server this worker is alive, on connections of their own (a pull waiting
        for a step must not hold up the heartbeat); a server that drops it is rejoined by the
        next push or pull."""
        beats: list[FramedTransport | None] = [None] * len(self.servers)
        missed = [0] * len(self.servers)
        wait = max(self.heartbeat * 4, 1.0)
        options = self._options._replace(connect_timeout=wait, request_timeout=wait)

        async def beat(i: int) -> None:
            try:
                conn = beats[i]
                if conn is None or conn.closed or str(conn.address) != str(Address.parse(self._url(i))):
                    if conn is not None:
                        await conn.close()
                    conn = beats[i] = await self._open(self._url(i), options)
                head = wps.PsHead(self.rank, self.world_size, self._clocks[i], self.incarnation)
                await conn.call(Opcode.PS_HEARTBEAT, head.encode(), what="a heartbeat")
                missed[i] = 0
            except TensorwireError as exc:
                log.debug("heartbeat to %s failed: %s", self._url(i), exc)
                missed[i] += 1
                if missed[i] == 2:  # the server is unreachable (cut off, gone without a reset)
                    await self._abandon(i)

        try:
            while True:
                await asyncio.gather(*(beat(i) for i in self._servers()))
                await asyncio.sleep(self.heartbeat)
        finally:
            for conn in beats:
                if conn is not None:
                    await conn.close()

    async def _abandon(self, server: int) -> None:
        """Drop the connection to a server that stopped answering heartbeats: a request waiting on
        it fails now and is resent (on the next replica, if any) instead of waiting out its timer."""
        conn = self._conns[server]
        if conn is not None and not conn.closed:
            log.warning("worker %d: %s stopped answering heartbeats; dropping its connection", self.rank,
                        self._url(server))  # fmt: skip
            await conn.close()

    async def _leave(self) -> None:
        """Leave every server that can be reached now (no retries: the process may be ending)."""
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        try:
            if self._joined:
                head = wps.PsHead(self.rank, self.world_size, 0, self.incarnation).encode()
                calls = [c.call(Opcode.PS_LEAVE, head, what="PS_LEAVE", timeout=self.connect_timeout)
                         for c in self._conns if c is not None and not c.closed]  # fmt: skip
                await asyncio.gather(*calls, return_exceptions=True)
        finally:
            for conn in self._conns:
                if conn is not None:
                    await conn.close()

    async def _request(
        self,
        server: int,
        opcode: Opcode,
        body: bytes,
        data: Sequence[memoryview] = (),
        *,
        sink: transports.base.Sink | None = None,
        clock: int | None = None,
        seq: int = 0,
    ) -> wm.MetaReader:
        """One request to one server, resent on a new connection while the network fails (a
        broken connection, a server restarting), for at most ``timeout`` seconds."""
        worker = wps.OBSERVER if self.observer else self.rank
        tick = self._clocks[server] if clock is None else clock
        head = wps.PsHead(worker, self.world_size, tick, seq, int(self.timeout * 1000)).encode()
        what = f"{opcode.name} from worker {self.rank} to {self.servers[server]}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        for attempt in itertools.count(1):
            try:
                conn = await self._connection(server)
                return await conn.call(opcode, head + body, data, sink, what=what)
            except TensorwireError as exc:  # a broken connection, a corrupt chunk: resend
                if not exc.retryable or loop.time() >= deadline:
                    raise
                log.info("%s failed (%s); retrying", what, exc)
                if isinstance(exc, (ConnectError, ConnectionLost, NotPrimary)):
                    await self._next_replica(server)
                # Short, capped waits: during a failover the backup takes over at a moment this
                # side cannot know, and each doubling past it would add to the pause.
                await asyncio.sleep(min(0.05 * 2**attempt, RETRY_CAP, max(deadline - loop.time(), 0)))
        raise AssertionError("unreachable")

    # -- helpers --------------------------------------------------------------------------------
    def _session(self) -> int:
        """What a request's ``seq`` says of who sends it: this process's incarnation, or 0 for an
        observer (which acts as no rank)."""
        return 0 if self.observer else self.incarnation

    def _servers(self) -> list[int]:
        """The servers this worker talks to: those the placement gives a shard (a model with
        fewer elements than there are servers leaves some without)."""
        return [i for i, shards in enumerate(self._shards) if shards]

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

    def _take_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient, taken from the module (None where backward made none: the
        server then leaves that parameter alone, as torch.optim does)."""
        grads: dict[str, torch.Tensor | None] = {}
        for name, param in self._params.items():
            grad = param.grad
            if grad is not None and (grad.is_sparse or grad.dtype != param.dtype):
                raise ProtocolError(f"the gradient of {name!r} must be dense {param.dtype}")
            grads[name] = None if grad is None else grad.contiguous()
            param.grad = None
        return grads

    def _meta(self, shard: Shard) -> TensorMeta:
        dtype = self._params[shard.param].dtype
        return TensorMeta(shard.key, dtype, (shard.numel,), shard.numel * dtype.itemsize)

    @staticmethod
    def _view(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
        return tensor.view(-1)[shard.start : shard.stop]


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
) -> int:
    """Write a job's current parameters into ``model`` without joining it (evaluation, export)."""
    with Worker(
        model, servers, rank=0, world_size=1, timeout=timeout, token=token, tls=tls, observer=True
    ) as reader:
        return reader.version


def server_stats(
    servers: Sequence[str],
    *,
    timeout: float = 10.0,
    token: str | None = None,
    security: Security | None = None,
) -> list[dict[str, Any]]:
    """Each server's ``PS_STATS`` answer, without joining anything (``tensorwire ps stats``).
    ``security``: TLS files and token (default: ``token``, else ``$TENSORWIRE_TOKEN``)."""
    from tensorwire._aio import run

    security = security or Security(None, client_token(token))
    options = transports.TransportOptions(timeout, timeout, security=security)

    async def one(url: str) -> dict[str, Any]:
        conn = await transports.open_transport(Address.parse(url), options)
        try:
            if not isinstance(conn, FramedTransport):
                raise ValueError(f"parameter servers speak tcp://, tls:// or memory://, not {url}")
            reader = await conn.call(Opcode.PS_STATS, wps.PsHead(wps.OBSERVER).encode(), what="PS_STATS")
            doc: dict[str, Any] = json.loads(wps.decode_stats(reader))
            return doc
        finally:
            await conn.close()

    async def every() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(one(url) for url in servers)))

    return run(every())


def resolve_servers(servers: Sequence[str] | str | None, rank: int, timeout: float) -> list[str]:
    """The servers' URLs: given, else ``$TENSORWIRE_SERVERS``, else from torchrun's store."""
    if servers is None:
        servers = os.environ.get(SERVERS_ENV)
    if isinstance(servers, str):
        servers = [url.strip() for url in servers.split(",") if url.strip()]
    store = _torchrun_store(timeout)
    if servers:
        if store is not None and rank == 0:
            store.set(STORE_KEY, ",".join(servers))  # for ranks started without the list
        return list(servers)
    if store is None:
        raise ValueError(f"no parameter servers: pass servers=, or set ${SERVERS_ENV}, or run under torchrun")
    try:
        published = store.get(STORE_KEY).decode()
    except Exception as exc:  # the store raises its own timeout and connection errors
        raise TensorwireError(
            f"waited {timeout:.3g}s for rank 0 to publish the servers in torchrun's store ({exc})"
        ) from exc
    return str(published).split(",")


def _torchrun_store(timeout: float) -> Any:
    """A client of the store torchrun's agent hosts, when this process runs under torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))  # type: ignore[attr-defined]


def env_int(name: str, given: int | None, default: int) -> int:
    if given is not None:
        return given
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name} must be a whole number, not {raw!r}") from None


def model_digest(params: dict[str, torch.nn.Parameter]) -> str:
    """``"<parameters>:<digest>"`` of the model's parameters' names, shapes and dtypes, in order:
    the servers refuse a worker whose model is not the job's (JobConfig.model)."""
    described = json.dumps([[name, list(p.shape), str(p.dtype)] for name, p in params.items()])
    return f"{len(params)}:{hashlib.sha256(described.encode()).hexdigest()[:32]}"


def _check_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    params = dict(model.named_parameters())
    if not params:
        raise ValueError("the model has no parameters to train")
    for name, param in params.items():
        check_trainable(name, param)
    return params


def check_trainable(name: str, tensor: torch.Tensor) -> None:
    """InvalidTensor unless ``tensor`` can be sent and landed in place: contiguous, float, CPU."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.dtype.is_floating_point:
        raise InvalidTensor(f"{name!r} must be a contiguous floating-point CPU tensor")
