"""A worker's pulls through the relay (``ps.Worker(pull="relay")``): ``RelayPulls``.

With ``pull="relay"``, a worker pulls each server's shards of a new version like this:

1. PS_RELAY to the server (through the slot: resent, failed over, as every request): it waits for
   the pull's gate exactly as PS_PULL does, makes sure the version is published as a generation of
   ``_ps/<job>`` in its generation store (ps/server/relay.py), and answers (version, generation number).
2. RELAY_JOIN, RELAY_GET, RELAY_REPORT to the replica that answered, as a ``Subscriber`` does
   (broadcast/relay_pull.py): the server strings the job's workers into chains, and each worker
   pulls the chunks from the one before it (or from the server), straight into the module's
   parameters, checks each against the server's manifest, and forwards it to the next through a
   relay server of its own (``RelayPeer`` on port 0: the relay token derived from the job's token,
   and under TLS its certificate and the cluster's CA, broadcast/peer.py). A dead or corrupt
   upstream is routed around (RELAY_REPORT FAILED). The join names this worker's session (its
   incarnation), which the PS_RELAY admitted to register in the job's chains, so no reader outside
   the job (an observer) is ever upstream of a worker; it goes, with the reports and the chunks,
   over this reader's own tcp:// or tls:// connection to the replica (whatever the slot's own
   connection is: shm:// on the server's host), whose address the relay address is checked against.

So the server's link carries each version about once, instead of once per worker. In ``sync``
mode every worker reads the generation its PS_RELAY named (the next one cannot exist before all
of them pushed again); otherwise a worker reads the newest, which is at least as new.

Where the relay cannot serve a pull (the server cannot publish: an old server, a full store; the
manifest is not this worker's shards; the relay fails past its reroutes, or runs out of time),
the pull falls back to a direct PS_PULL: a warning is logged and ``fallbacks`` counted, never
silently. A worker the server dropped (WorkerDropped) and a gate that timed out are not fallbacks:
they are raised as from a direct pull.

Lifecycle: the worker makes one ``RelayPulls`` and calls ``pull(slot)`` from its event loop
(concurrently for different slots), then ``close()`` once on the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import torch

from tensorwire.broadcast import peer as relay_peer
from tensorwire.broadcast import relay_pull
from tensorwire.broadcast.peer import RelayPeer
from tensorwire.errors import (
    ProtocolError,
    TensorwireError,
    UnsupportedTransport,
    VersionChanged,
    WaitTimeout,
    WorkerDropped,
)
from tensorwire.logs import event
from tensorwire.ps.job import relay_name, relay_prefix
from tensorwire.ps.placement import Shard
from tensorwire.ps.worker.slot import ServerSlot
from tensorwire.server import Server
from tensorwire.transport import TransportOptions
from tensorwire.types import Address
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.tensors import byte_view

log = logging.getLogger("tensorwire.ps.worker")
RELAY_SCHEMES = ("tcp", "tls")


def check_relay_servers(servers: Sequence[str]) -> None:
    """ValueError unless every replica of every server is tcp:// or tls:// (relay peers connect to
    each other over TCP)."""
    for server in servers:
        for url in server.split("|"):
            if Address.parse(url).scheme not in RELAY_SCHEMES:
                raise ValueError(f"pull='relay' needs tcp:// or tls:// servers, not {url!r}")


class SlotReader:
    """One server's relay, as this worker reads it (a ``broadcast.relay_pull.RelayReader``)."""

    def __init__(
        self,
        job: str,
        url: str,
        options: TransportOptions,
        stall_timeout: float,
        window: int,
        *,
        peer_timeout: float = 2.0,
    ) -> None:
        self.prefix = relay_prefix(job)
        self.job = job
        self.reader_id = 0
        self.received = 0
        self.joins_refused = 0  # joins the server refused for the relay address (relay_pull.join)
        self.window = window
        self.stall_timeout = stall_timeout
        self.peer_timeout = peer_timeout
        self.peer = RelayPeer(max_wait=stall_timeout)
        self.progress: Callable[[int], None] | None = None
        self.relay_address = ""
        self.holds = 0  # the generation this worker's memory holds and serves (0: none)
        self._options = options
        # "": the replica read from (``_at`` moves it), with the worker's credentials
        self.channels = relay_pull.Channels(Address.parse(url), options, peer_timeout, "a relay pull")
        self._server: Server | None = None

    @property
    def origin(self) -> Address:
        """The replica read from."""
        return self.channels.origin

    async def read(
        self,
        url: str,
        number: int,
        exact: bool,
        buffers: Callable[[wr.Manifest], list[memoryview]],
        session: int = 0,
    ) -> None:
        """Generation ``number`` (``exact``; else the newest, at least ``number``) from the replica
        at ``url`` through the relay, into ``buffers(manifest)``; the join names ``session`` (this
        worker's incarnation, which its PS_RELAY admitted)."""
        await self._at(url)
        deadline = time.monotonic() + self._options.request_timeout
        manifest, placement = await relay_pull.join(self, 0, await self._relay_url(), session)
        self.reader_id = placement.reader
        try:
            if manifest.generation < number or (exact and manifest.generation != number):
                raise VersionChanged(f"{url} relays generation {manifest.generation}, not {number}")
            views = buffers(manifest)  # nothing is written if the manifest is not this worker's
            self.stop_serving()
            self.peer.hold(self.prefix, manifest, views)
            await relay_pull.pull(self, manifest, placement, views, deadline)
        except BaseException:
            self.stop_serving()
            await self._leave(manifest.generation)
            raise
        self.holds = manifest.generation
        await relay_pull.report(self, manifest.generation, wr.Report.DONE, 0)

    def stop_serving(self) -> None:
        """The parameters are about to be overwritten: they no longer hold a generation to forward."""
        self.peer.drop()
        self.holds = 0

    async def _at(self, url: str) -> None:
        """Read from the replica at ``url`` (a failover moved the slot: drop what led elsewhere)."""
        origin = Address.parse(url)
        if origin != self.origin:
            self.stop_serving()
            await self.channels.move(origin)
            self.reader_id = 0

    # -- connections (relay_pull.RelayReader) -----------------------------------------------------
    async def _origin_call(self, opcode: int, body: bytes, what: str) -> wm.MetaReader:
        """A join or a report, over this reader's own connection to the replica (its registration
        belongs to that connection and goes when it closes)."""
        return await self.channels.call(opcode, body, f"{what} of {self.prefix!r}")

    async def _relay_url(self) -> str:
        """This worker's relay server for this slot, started on first use."""
        if self._server is None:
            security = self._options.security
            try:
                relay_peer.check_peer_tls(security, self.origin.scheme)
            except ValueError as exc:  # the pull falls back to a direct one, with a warning
                raise UnsupportedTransport(str(exc)) from exc
            try:
                self._server, self.relay_address = await relay_peer.serve(
                    self.peer, self.origin, security, None, self.stall_timeout
                )
            except ValueError as exc:  # a certificate its peers would refuse: a direct pull, warned
                raise UnsupportedTransport(str(exc)) from exc
        return self.relay_address

    async def _leave(self, generation: int) -> None:
        if generation and self.reader_id:
            with contextlib.suppress(TensorwireError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await relay_pull.report(self, generation, wr.Report.LEAVE, 0)
            self.reader_id = 0

    async def close(self) -> None:
        await self._leave(self.holds)
        self.stop_serving()
        await self.channels.close()
        if self._server is not None:
            await self._server.close()
            self._server = None


class RelayPulls:
    """The relay pulls of one worker, one ``SlotReader`` per server (see the module doc)."""

    def __init__(
        self,
        job: str,
        options: TransportOptions,
        params: dict[str, torch.nn.Parameter],
        *,
        exact: bool,
        stall_timeout: float = 10.0,
        window: int = 4,
    ) -> None:
        self.job = job
        self.exact = exact
        self.pulls = 0  # pulls through the relay
        self.fallbacks = 0  # pulls that fell back to a direct pull
        self._params = params
        self._options = options._replace(prefer_local=False)  # relay peers speak TCP
        self._stall = stall_timeout
        self._window = window
        self._readers: dict[str, SlotReader] = {}

    @property
    def received(self) -> int:
        """Data bytes pulled through the relay, every server together."""
        return sum(r.received for r in self._readers.values())

    async def pull(self, slot: ServerSlot, clock: int, session: int) -> tuple[int, int] | None:
        """Pull ``slot``'s shards through the relay: (the version, the bytes received), or None
        after a warning when the pull must be made directly (see the module doc)."""
        reader = self._readers.get(slot.name)
        if reader is None:
            reader = SlotReader(self.job, slot.url, self._options, self._stall, self._window)
            self._readers[slot.name] = reader
        try:
            version, number = await slot.rpc.relay(clock, session)
        except (WorkerDropped, WaitTimeout):
            raise
        except TensorwireError as exc:
            self._fell_back(reader, slot, "PS_RELAY", exc)
            return None
        received = reader.received
        try:
            bind = lambda m: self._bind(slot.shards, m)  # noqa: E731
            await reader.read(slot.url, number, self.exact, bind, session)
        except (TensorwireError, TimeoutError) as exc:
            self._fell_back(reader, slot, f"generation {number}", exc)
            return None
        self.pulls += 1
        return version, reader.received - received

    def _fell_back(self, reader: SlotReader, slot: ServerSlot, what: str, exc: BaseException) -> None:
        reader.stop_serving()  # the direct pull overwrites the parameters
        self.fallbacks += 1
        event(log, logging.WARNING, "relay pull falls back to a direct pull", server=slot.name, job=self.job,
              what=what, error=repr(exc), fallbacks=self.fallbacks)  # fmt: skip

    def _bind(self, shards: Sequence[Shard], manifest: wr.Manifest) -> list[memoryview]:
        """The parameters' bytes, in the manifest's order; ProtocolError (nothing written) unless the
        manifest holds exactly these shards, each with its dtype and size."""
        by_name = {relay_name(self.job, s.key): s for s in shards}
        names = [m.name for m in manifest.metas]
        if sorted(names) != sorted(by_name):
            raise ProtocolError(f"the relay's generation {manifest.generation} is not this worker's shards")
        views = []
        for meta in manifest.metas:
            shard = by_name[meta.name]
            param = self._params[shard.param]
            if (meta.dtype, tuple(meta.shape), meta.nbytes) != (
                param.dtype,
                (shard.numel,),
                shard.numel * param.element_size(),
            ):
                raise ProtocolError(f"the relay's {meta.name!r} is {meta.dtype}{list(meta.shape)}")
            views.append(byte_view(param.data.view(-1)[shard.start : shard.stop]))
        return views

    async def close(self) -> None:
        for reader in self._readers.values():
            with contextlib.suppress(TensorwireError):
                await reader.close()
