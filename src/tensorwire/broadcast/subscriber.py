"""``Subscriber``: keeps a model's tensors at the newest generation of a prefix, read through the
relay so that the origin sends the model's bytes about once whatever the number of readers.

How one ``update()`` goes (docs/protocol.md §15 has the wire side):

1. RELAY_JOIN to the origin, over the authenticated connection: the newest generation's manifest
   (tensor records, chunk size, one checksum per chunk) and the upstream to pull from — the origin
   itself, or the reader that joined just before (the origin strings readers into pipelined
   chains, chains.py). An origin that does not register this reader's relay address (not the IP
   its connection comes from, say: a multi-homed host, NAT) answers the origin, and the reader
   reads from it; one that refuses the address is asked again without it (relay_pull.join).
2. Chunks are pulled in order from the upstream (RELAY_GET, one chunk per request, ``window``
   requests in flight: pipeline.py), straight into the target tensors' memory; each is checked
   against the manifest's checksum (a relay peer is not trusted: only the manifest, which comes
   from the origin, is) before it counts as received. As soon as it and every chunk before it are,
   this reader's own relay server (peer.py, a ``Server`` with the cluster's token and TLS) may
   forward it to the reader after it: every hop forwards chunk k while receiving chunk k+1.
3. An upstream that cannot be reached within ``peer_timeout``, sends no first chunk within it
   either, drops the connection, stalls past ``stall_timeout``, refuses, or sends a chunk whose
   checksum fails is reported to the origin
   (RELAY_REPORT FAILED); the origin drops it from the chain and answers itself as the new upstream,
   and the pull goes on from the lowest chunk not verified yet. A reader sends the cluster's token
   only to the origin: its peers get the relay token derived from it (peer.py).
4. RELAY_REPORT DONE: this reader holds the whole generation and stays an upstream for readers
   that join later, until its next ``update()`` starts overwriting its tensors.

Deltas (``deltas=True``, the default): a reader that holds generation ``b`` (its last ``update()``
returned ``b``, and no update since has written into the tensors) reads a newer ``g`` from the
origin itself as a delta read (``get_many(at=g, base=b)``; delta_update.py, client/deltas.py)
instead of joining the relay: only what changed, per chunk, applied in place and checked against
``g``'s chunk checksum; a delta is small, so the origin's link carries N of them. Readers at
different generations each get their own delta; a reader with nothing (its first update, or after a
failure) gets everything, through the relay, and so does one whose base the origin no longer keeps
(one retired during the read costs full chunks from the origin). Tensors changed by the user since
``b`` are caught by the per-chunk checksum and those chunks fetched again in full, so the result is
``g`` bit for bit either way. A delta read that fails once it has started writing leaves the tensors
a mix: the update falls back to the relay for the whole generation (a warning says so).
``stats()["updates"]`` says, per update, which way it went, the bytes it received and why a delta
was given up.

While ``update()`` runs the tensors are being overwritten; after it returns they hold exactly the
generation it returns (bit for bit). If it raises having written, they may hold a mix: the next
``update()`` fetches the whole generation again (``generation`` is 0 until then). Tensors must be
contiguous CPU tensors; ``into``'s keys (a ``state_dict``'s, or a module's) are the keys
``client.publish(prefix, ...)`` was given.

``share="shm://127.0.0.1:0"`` makes this reader its host's leader: each update's generation is
also shared over shared memory with the host's other processes (``HostReader``; host.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, TypeVar, cast

import torch

from tensorwire._aio import LoopThread
from tensorwire.broadcast import delta_update, relay_pull
from tensorwire.broadcast import peer as relay_peer
from tensorwire.broadcast.delta_update import UpdateRecord
from tensorwire.broadcast.host import HostShare
from tensorwire.broadcast.peer import RelayPeer
from tensorwire.client import deltas as delta_reads
from tensorwire.errors import (
    GenerationRetired,
    InvalidTensor,
    KeyNotFound,
    TensorwireError,
    VersionChanged,
)
from tensorwire.logs import event
from tensorwire.security import Security, TlsFiles, client_tls, client_token
from tensorwire.server import Server
from tensorwire.store.generation_config import DEFAULT_MAX_LEASE_SECONDS
from tensorwire.transport import TransportOptions
from tensorwire.transport.base import Transport, as_generational
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view, check_out

T = TypeVar("T")
log = logging.getLogger("tensorwire.broadcast")

MAX_MANIFEST_CHUNKS = relay_pull.MAX_MANIFEST_CHUNKS
MAX_RESTARTS = 3  # generations retired under one update before it gives up
KEEP_UPDATES = 64  # updates ``stats()["updates"]`` remembers


class Subscriber:
    """Brings the newest generation of ``prefix`` on the server at ``url`` into ``into`` (a module
    or a ``state_dict``), in place: see the module docstring.

    ``relay``: serve the chunks to other readers (a relay server on ``listen_host``, default the
    address this host reaches the origin from; under tls:// it needs ``tls`` with this reader's
    certificate, key and the cluster's CA: peer.py). ``stall_timeout``: how long an upstream may
    keep a chunk waiting before it is routed around; ``peer_timeout``: how long connecting to an
    upstream, and then its first chunk, may take. ``window``: single-chunk requests kept in flight.
    ``progress(chunks)`` hears, on a worker thread, how many chunks of the generation are verified.
    ``deltas``: a reader holding a generation reads a newer one as a delta from the origin (see
    the module docstring: readers at different generations each get their own delta; a reader
    with nothing gets everything, through the relay). ``share`` (e.g. "shm://127.0.0.1:0"): also
    share each generation with this host's ``HostReader``s, at ``share_url`` (host.py); a share
    that cannot take a generation is logged and counted (``share_failures``), and the update, which
    brought it into ``into``, still returns it. ``share_lease_seconds``: how long a follower's views
    pin their generation in the share at most (after that they still read, but no longer hold the
    share's room: followers that keep old generations cannot fill it for longer).
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        into: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        relay: bool = True,
        listen_host: str | None = None,
        timeout: float = 60.0,
        stall_timeout: float = 10.0,
        connect_timeout: float = 10.0,
        window: int = 4,
        progress: Callable[[int], None] | None = None,
        deltas: bool = True,
        share: str | None = None,
        peer_timeout: float = 2.0,
        share_lease_seconds: float = DEFAULT_MAX_LEASE_SECONDS,
    ) -> None:
        self.origin = Address.parse(url)
        if relay and self.origin.scheme not in ("tcp", "tls"):
            raise ValueError(f"a relay needs a tcp:// or tls:// origin, not {url!r} (or pass relay=False)")
        self.prefix = prefix
        self.targets = _targets(prefix, into)
        self.security = Security(tls=client_tls(tls), token=client_token(token))  # or $TENSORWIRE_*
        if relay:
            relay_peer.check_peer_tls(self.security, self.origin.scheme)
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.peer_timeout = peer_timeout
        self.window = max(1, min(window, 64))
        self.progress = progress
        self.generation = 0  # the generation the tensors hold (0: none yet)
        self.reader_id = 0  # this reader's id in the generation's relay (0: not in one)
        self.relay_address = ""  # where this reader serves RELAY_GET, once it does
        self.peer = RelayPeer(max_wait=stall_timeout)
        self.deltas = deltas
        self.delta_stats = delta_reads.DeltaStats()  # what this reader's delta reads moved
        self.updates: deque[UpdateRecord] = deque(maxlen=KEEP_UPDATES)  # the last few, newest last
        self.received = 0  # data bytes pulled through the relay, all updates
        self.joins_refused = 0  # joins the origin refused for the relay address (relay_pull.join)
        self.share_failures = 0  # generations the host share could not take (logged each time)
        self._relay = relay
        self._listen_host = listen_host
        options = TransportOptions(connect_timeout, timeout, security=self.security)
        self.channels = relay_pull.Channels(self.origin, options, peer_timeout, "a Subscriber")
        self._server: Server | None = None
        self._loop = LoopThread("tensorwire-subscriber")
        self.share = self._start_share(share, connect_timeout, share_lease_seconds) if share else None
        self.share_url = self.share.url if self.share else ""  # what this host's HostReaders read

    def _start_share(self, listen: str, timeout: float, lease_seconds: float) -> HostShare:
        """The host share's server; the loop thread is stopped if it cannot start (the caller never
        gets an object to close)."""
        try:
            start = HostShare.start(
                listen, self.prefix, self.targets, self.security, lease_seconds=lease_seconds
            )
            return self._loop.call(start, timeout, f"serving {listen}")
        except BaseException:
            self._loop.stop()
            raise

    # -- the blocking API ------------------------------------------------------------------------
    def update(self, timeout: float | None = None) -> int:
        """Bring the newest generation into the tensors (nothing moves if they hold it already);
        return its number. TransferTimeout after ``timeout`` seconds (default: the constructor's)."""
        wait = self.timeout if timeout is None else timeout
        number = self._loop.call(
            self._update(time.monotonic() + wait), wait + 5.0, f"an update of {self.prefix!r}"
        )
        if self.share is not None:  # only now: every chunk is in and verified
            self._share(self.share, number, wait)
        return number

    def _share(self, share: HostShare, number: int, wait: float) -> None:
        """Share generation ``number`` with this host's followers. A share that cannot take it (its
        followers pin older ones and fill its store) fails them, not this reader, whose update
        brought the generation: a warning and ``share_failures`` say so."""
        try:
            self._loop.call(share.publish(number, self.targets), wait, f"sharing on {share.url}")
        except TensorwireError as exc:
            self.share_failures += 1
            event(log, logging.WARNING, "host share did not take the generation", share=self.share_url,
                  generation=number, failures=self.share_failures, error=repr(exc))  # fmt: skip

    def wait_and_update(self, timeout: float) -> int:
        """Wait (the server notifies; no polling) until a generation newer than the one held is
        published, then ``update()``; WaitTimeout if none comes within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        self._loop.call(self._wait(timeout), timeout + 5.0, f"a new generation of {self.prefix!r}")
        return self.update(max(deadline - time.monotonic(), 1.0))

    def stats(self) -> dict[str, Any]:
        """The origin's RELAY_STATS for this prefix (what it served for each generation), with this
        reader's own: ``updates`` (``UpdateRecord``s, the last few, newest last) and ``deltas``
        (``DeltaStats``, summed over its delta reads)."""
        doc = self._loop.call(self._stats(), self.timeout, "the relay's stats")
        doc["updates"] = [asdict(record) for record in self.updates]
        doc["deltas"] = asdict(self.delta_stats)
        return doc

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._loop.call(self._close(), 10.0, "closing the subscriber")
        self._loop.stop()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one update ---------------------------------------------------------------------------------
    async def _update(self, deadline: float) -> int:
        """One update; again with the newest generation if the origin retired the one being read
        (a publisher faster than the readers)."""
        for attempt in range(MAX_RESTARTS):
            try:
                return await self._update_once(deadline)
            except (GenerationRetired, VersionChanged):
                if attempt == MAX_RESTARTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _update_once(self, deadline: float) -> int:
        fallback = ""
        if self.deltas and self.generation:
            got = await delta_update.update(self, deadline)  # delta_update.py
            if isinstance(got, int):
                return got
            fallback = got
        return await self._relay_update(deadline, fallback)

    async def _relay_update(self, deadline: float, fallback: str) -> int:
        base = self.generation
        manifest, placement = await relay_pull.join(self, self.generation, await self._relay_url())
        if manifest.generation == self.generation:
            self.updates.append(UpdateRecord(self.generation, base, "current", 0, fallback))
            return self.generation
        self.reader_id = placement.reader
        try:
            buffers = self._bind(manifest.metas, manifest.generation)
        except TensorwireError:  # `into` cannot take it: nothing was written; out of the relay
            await self._leave(manifest.generation)
            raise
        self.generation = 0  # the tensors are being overwritten
        self.peer.hold(self.prefix, manifest, buffers)
        received = self.received
        try:
            await self._pull(manifest, placement, buffers, deadline)
        except BaseException:
            self.peer.drop()
            await self._leave(manifest.generation)
            raise
        self.generation = manifest.generation
        moved = self.received - received
        self.updates.append(UpdateRecord(manifest.generation, base, "relay", moved, fallback))
        await self._report(manifest.generation, wr.Report.DONE, 0)
        return manifest.generation

    def _bind(self, metas: Sequence[TensorMeta], generation: int) -> list[memoryview]:
        """The target tensors' bytes, in ``metas``' order; InvalidTensor/KeyNotFound if one is
        missing or cannot take the published tensor in place."""
        buffers = []
        for meta in metas:
            target = self.targets.get(meta.name)
            if target is None:
                raise KeyNotFound(f"generation {generation} has {meta.name!r}, which `into` lacks")
            check_out(meta, target)
            buffers.append(byte_view(target))
        return buffers

    async def _stop_serving(self) -> None:
        self.peer.drop()
        await self._leave(self.generation)

    async def _pull(
        self, manifest: wr.Manifest, placement: wr.Placement, buffers: list[memoryview], deadline: float
    ) -> None:
        await relay_pull.pull(self, manifest, placement, buffers, deadline)  # relay_pull.py

    async def _report(self, generation: int, what: wr.Report, upstream: int) -> wr.Placement:
        return await relay_pull.report(self, generation, what, upstream)

    async def _stats(self) -> dict[str, Any]:
        reader = await self._origin_call(Opcode.RELAY_STATS, wr.encode_stats(self.prefix), "RELAY_STATS")
        doc: dict[str, Any] = json.loads(wr.decode_json(reader))
        return doc

    async def _wait(self, timeout: float) -> None:
        channel = await self.channels.get()  # a RangedTransport: also Generational
        generational = as_generational(cast(Transport, channel), "Subscriber.wait_and_update")
        await generational.wait(self.prefix, self.generation, timeout)

    # -- connections ------------------------------------------------------------------------------
    async def _on_origin(self, op: Callable[[Transport], Awaitable[T]], idempotent: bool = True) -> T:
        """``op`` on the connection to the origin (a ``client.generations.Run``; not retried: a
        failed delta update falls back to the relay)."""
        channel = await self.channels.get()  # a RangedTransport: also Generational
        return await op(cast(Transport, channel))

    async def _origin_call(self, opcode: int, body: bytes, what: str) -> wm.MetaReader:
        """One request to the origin; a connection found broken is reopened once (Channels.call)."""
        return await self.channels.call(opcode, body, what, reopen=True)

    async def _relay_url(self) -> str:
        """This reader's relay address, its server started on first use ("" without a relay)."""
        if not self._relay:
            return ""
        if self._server is None:
            try:
                self._server, self.relay_address = await relay_peer.serve(
                    self.peer, self.origin, self.security, self._listen_host, self.stall_timeout
                )
            except ValueError as exc:  # no address, or a certificate its peers would refuse
                self._relay = False
                event(log, logging.WARNING, "this reader does not relay: it reads from the origin",
                      prefix=self.prefix, error=str(exc))  # fmt: skip
                return ""
        return self.relay_address

    async def _leave(self, generation: int) -> None:
        """Tell the origin this reader no longer serves ``generation`` (best effort: a dead origin
        forgets it anyway)."""
        if generation and self.reader_id:
            with contextlib.suppress(TensorwireError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await self._report(generation, wr.Report.LEAVE, 0)
            self.reader_id = 0

    async def _close(self) -> None:
        await self._leave(self.generation)
        self.peer.drop()
        await self.channels.close()
        if self._server is not None:
            await self._server.close()
            self._server = None
        if self.share is not None:
            await self.share.close()


def _targets(prefix: str, into: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = into.state_dict(keep_vars=True) if isinstance(into, torch.nn.Module) else dict(into)
    targets = {}
    for key, tensor in tensors.items():
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise InvalidTensor(f"{key!r}: a Subscriber writes into contiguous CPU tensors in place")
        targets[full_name(prefix, key)] = tensor
    return targets


def full_name(prefix: str, key: str) -> str:
    """The published name of ``key`` under ``prefix``: ``prefix/key`` (as ``client.publish`` names
    it), or ``prefix + key`` for a prefix that ends with "/" (plain puts under a common prefix)."""
    return prefix + key if prefix.endswith("/") else f"{prefix}/{key}"
