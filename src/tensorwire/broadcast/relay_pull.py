"""Pulling one generation through the relay, chunk by chunk, rerouting around failed upstreams.

The reader's side of steps 2 and 3 of an update (subscriber.py's module doc): every chunk pulled
from the upstream the origin named (RELAY_GET, ``window`` single-chunk requests in flight:
pipeline.py), straight into the reader's memory, each checked against the origin's manifest before
it counts (a relay peer is not trusted); an upstream that fails is reported (RELAY_REPORT FAILED)
and the pull goes on from the origin's new answer. ``Subscriber`` pulls this way, and so does a
parameter-server worker that pulls through the relay (``ps.Worker(pull="relay")``).

An upstream is an address another reader registered, so it is not trusted until it serves: its
connection must open within ``peer_timeout`` (TCP, TLS, HELLO), under the origin's scheme only, with
the relay token rather than the cluster's (peer.py says why), its first chunk must come within
``peer_timeout`` too (a peer that has served nothing yet gets no more: an honest upstream is about
one chunk ahead, while a silent one would hold this reader, and every reader behind it, for a whole
stall), each later chunk within ``stall_timeout``, and the whole generation within half the
update's time left (a peer that sends valid chunks slowly, each just inside the stall bound, cannot
spend it all); past any bound the upstream is reported and the origin answers itself as the new
upstream (chains.py), so a hostile, slow or dead peer costs an honest reader at most one such wait
per generation. A pull that is done closes its upstream's connection (the next generation's
upstream is another).

Joining (``join``): a join the origin refuses because of this reader's relay address (InvalidName:
another connection holds it; LimitExceeded: its connection relays too many prefixes) is made
again without one, so the reader reads from the origin, unregistered, and its update goes on
(logged, counted in ``joins_refused``): a refused registration never fails an update.

The reader is anything with the attributes and connections of ``RelayReader``: its prefix, its id
in the generation's relay, its counters, its ``RelayPeer`` (which forwards what it verified) and
its ``Channels`` (``""``: the origin), the one connection cache both readers share.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from tensorwire import transport
from tensorwire._aio import asyncio_timeout
from tensorwire.broadcast import pipeline
from tensorwire.broadcast.peer import RelayPeer, peer_options
from tensorwire.errors import (
    CorruptFrame,
    InvalidName,
    LimitExceeded,
    ProtocolError,
    TensorwireError,
    TransferTimeout,
)
from tensorwire.logs import event
from tensorwire.transport import FrameChannel, TransportOptions
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.checksum import checksum
from tensorwire.wire.frame import Opcode

log = logging.getLogger("tensorwire.broadcast")

MAX_REROUTES = 64  # upstream failures one update survives before it gives up
ORIGIN_GRACE = 5.0  # seconds an answer from the origin may take past the stall bound
MAX_MANIFEST_CHUNKS = 1 << 24


class Channels:
    """A relay reader's connections, by address (``""``: the origin), each opened on first use and
    again once found ``closed``: to the origin with the reader's ``options`` (the cluster's
    credentials), to an upstream peer with the relay's (``peer.peer_options``: the relay token,
    ``peer_timeout`` to connect). ``what`` names the reader in an UnsupportedTransport.

    Lifecycle: the reader makes one, ``get``s connections as it needs them (relay_pull.py drops an
    upstream's when the upstream failed or served its generation), ``move``s it when the origin
    moves (a failover), and ``close``s it once, on the loop that opened them."""

    def __init__(self, origin: Address, options: TransportOptions, peer_timeout: float, what: str) -> None:
        self.origin = origin
        self._options = options
        self._peer_options = peer_options(options, peer_timeout)
        self._what = what
        self._open: dict[str, FrameChannel] = {}

    async def get(self, address: str = "") -> FrameChannel:
        """The open connection to ``address`` (``""``: the origin), opened if there is none."""
        channel = self._open.get(address)
        if channel is None or channel.closed:
            target, options = (address, self._peer_options) if address else (str(self.origin), self._options)
            channel = await transport.open_channel(target, options, what=self._what)
            self._open[address] = channel
        return channel

    async def call(self, opcode: int, body: bytes, what: str, *, reopen: bool = False) -> wm.MetaReader:
        """One request to the origin. With ``reopen``, a connection the request found broken (it is
        ``closed`` after the failure) is opened again and the request sent once more; a failure on a
        connection still open (a refusal, a timeout) is raised as it is, so a join or a report is
        never sent twice to an origin that may have taken it. Not ``client.retry.retrying``: that
        retries any retryable error, a timeout on a live connection included."""
        channel = await self.get()
        if not reopen:
            return await channel.call(opcode, body, what=what)
        try:
            return await channel.call(opcode, body, what=what)
        except TensorwireError:
            if not channel.closed:
                raise
        await self.drop()
        return await (await self.get()).call(opcode, body, what=what)

    async def drop(self, address: str = "") -> None:
        """Close the connection to ``address`` (``""``: the origin), if one is open."""
        channel = self._open.pop(address, None)
        if channel is not None:
            with contextlib.suppress(TensorwireError):
                await channel.close()

    async def move(self, origin: Address) -> None:
        """Read from ``origin`` from now on: the connection to the old one is closed."""
        if origin != self.origin:
            await self.drop()
            self.origin = origin

    async def close(self) -> None:
        for address in list(self._open):
            await self.drop(address)


class RelayReader(Protocol):
    """What a pull through the relay needs of its reader (``Subscriber`` is one)."""

    @property
    def origin(self) -> Address: ...

    prefix: str
    reader_id: int  # this reader's id in the generation's relay (0: not in one)
    received: int  # data bytes pulled through the relay, counted here
    window: int  # single-chunk requests kept in flight
    stall_timeout: float  # how long an upstream may keep a chunk waiting
    peer_timeout: float  # how long connecting to an upstream peer, and its first chunk, may take
    peer: RelayPeer
    progress: Callable[[int], None] | None
    joins_refused: int  # joins the origin refused for the relay address, made again without it

    channels: Channels  # its connections, ``""`` the origin's

    async def _origin_call(self, opcode: int, body: bytes, what: str) -> wm.MetaReader: ...


async def join(
    reader: RelayReader, after: int, relay: str, session: int = 0
) -> tuple[wr.Manifest, wr.Placement]:
    """RELAY_JOIN for the newest generation after ``after``, offering to relay at ``relay`` ("":
    not) for ``session`` (a parameter-server worker's incarnation, 0: none): its manifest and where
    to pull it from. A refusal of the address reads from the origin (the module docstring)."""
    body = wr.encode_join(reader.prefix, after, relay, session)
    try:
        answer = await reader._origin_call(Opcode.RELAY_JOIN, body, "RELAY_JOIN")
    except (InvalidName, LimitExceeded) as exc:
        if not relay:
            raise
        reader.joins_refused += 1
        event(log, logging.WARNING, "relay join refused: reading from the origin, unregistered",
              relay=relay, prefix=reader.prefix, refused=reader.joins_refused, error=repr(exc))  # fmt: skip
        body = wr.encode_join(reader.prefix, after, "", session)
        answer = await reader._origin_call(Opcode.RELAY_JOIN, body, "RELAY_JOIN")
    return wr.decode_join_reply(answer, MAX_MANIFEST_CHUNKS)


async def pull(
    reader: RelayReader,
    manifest: wr.Manifest,
    placement: wr.Placement,
    buffers: list[memoryview],
    deadline: float,
) -> None:
    """Every chunk, ``window`` single-chunk requests in flight (pipeline.py says why); a failed
    upstream is reported and the pull goes on from the lowest chunk not verified yet. An upstream
    peer gets half the time left (one that sends valid chunks just inside the stall bound, slowly,
    cannot spend it all): then it counts as failed, and the origin has the other half."""
    pulled, reroutes = pipeline.Pulled(manifest.chunks), 0
    while True:
        upstream = placement.address
        try:
            if await _pull_from(reader, upstream, manifest, buffers, pulled=pulled, deadline=deadline):
                return
        except TensorwireError as exc:
            if not upstream or reroutes >= MAX_REROUTES:
                raise  # the origin itself failed: the update fails
            event(log, logging.WARNING, "relay upstream failed", upstream=upstream,
                  generation=manifest.generation, chunk=pulled.verified, error=repr(exc))  # fmt: skip
            reroutes += 1
            await reader.channels.drop(upstream)
            placement = await report(reader, manifest.generation, wr.Report.FAILED, placement.upstream)
            continue
        raise TransferTimeout(
            f"the update to generation {manifest.generation} ran out of time at chunk {pulled.verified}"
        )


async def _pull_from(
    reader: RelayReader,
    upstream: str,
    manifest: wr.Manifest,
    buffers: list[memoryview],
    *,
    pulled: pipeline.Pulled,
    deadline: float,
) -> bool:
    """``pulled``'s missing chunks from ``upstream`` (``""``: the origin): True once all are in,
    False when the origin ran out of time; an upstream peer out of its time is TransferTimeout."""
    if not upstream:
        channel = await _upstream(reader, upstream)
        fetch_one = functools.partial(fetch, reader, channel, upstream, manifest, buffers=buffers)
        return await pipeline.pull(
            fetch_one, pulled, reader.window, deadline, functools.partial(advanced, reader)
        )
    until = time.monotonic() + max(deadline - time.monotonic(), 0.0) / 2
    channel = await _upstream(reader, upstream)  # opened here, once: the requests in flight share it
    fetch_one = functools.partial(fetch, reader, channel, upstream, manifest, buffers=buffers)
    first = asyncio.timeout(reader.peer_timeout)  # until it has served a chunk (the module docstring)

    async def served(verified: int) -> None:
        first.reschedule(None)
        await advanced(reader, verified)

    try:
        async with first:
            done = await pipeline.pull(fetch_one, pulled, reader.window, until, served)
    except TimeoutError as exc:
        if not first.expired():
            raise
        raise TransferTimeout(
            f"the upstream at {upstream} sent no chunk within peer_timeout ({reader.peer_timeout:.3g}s)"
        ) from exc
    if done:
        await reader.channels.drop(upstream)  # the next generation reads from another
    else:
        raise TransferTimeout(f"the upstream at {upstream} did not send the generation in half the time left")
    return done


async def _upstream(reader: RelayReader, address: str) -> FrameChannel:
    """The connection to ``address`` (``""``: the origin); an upstream peer's must be of the origin's
    scheme (no plain text under a TLS origin) and open within ``peer_timeout``."""
    if not address:
        return await reader.channels.get()
    scheme = address.partition("://")[0]
    if scheme != reader.origin.scheme:
        raise InvalidName(f"upstream {address} is not {reader.origin.scheme}:// as the origin is")
    async with asyncio_timeout(reader.peer_timeout, f"connecting to the upstream at {address}"):
        return await reader.channels.get(address)


async def advanced(reader: RelayReader, verified: int) -> None:
    """Chunks 0 .. ``verified``-1 are in and checked: the reader after this one may have them."""
    reader.peer.advance(verified)
    if reader.progress is not None:
        await asyncio.to_thread(reader.progress, verified)


async def fetch(
    reader: RelayReader,
    channel: FrameChannel,
    address: str,
    manifest: wr.Manifest,
    chunk: int,
    *,
    buffers: Sequence[memoryview],
) -> None:
    """Pull chunk ``chunk`` over ``channel``, to the upstream at ``address`` ("": the origin),
    into the tensors and verify it against the manifest."""
    index, offset, length = manifest.span(chunk, 1)
    meta = manifest.metas[index]
    dest = buffers[index][offset : offset + length]

    def sink(metas: list[TensorMeta]) -> list[memoryview]:
        if len(metas) != 1 or metas[0].name != meta.name or metas[0].nbytes != length:
            raise ProtocolError(f"an upstream answered chunk {chunk} of {meta.name!r} with something else")
        return [dest]

    wait_ms = int(reader.stall_timeout * 1000)
    body = wr.encode_get(reader.prefix, manifest.generation, chunk, 1, wait_ms)
    grace = reader.peer_timeout if address else ORIGIN_GRACE  # a peer's chunk is short to send
    answer = await channel.call(
        Opcode.RELAY_GET, body, sink=sink, what=f"RELAY_GET of chunk {chunk}",
        timeout=reader.stall_timeout + grace,
    )  # fmt: skip
    answer.done()
    if checksum(manifest.kind, dest) != manifest.checksums[chunk]:
        source = address or str(reader.origin)
        raise CorruptFrame(f"chunk {chunk} from {source} does not match the origin's manifest")
    reader.received += length


async def report(reader: RelayReader, generation: int, what: wr.Report, upstream: int) -> wr.Placement:
    """RELAY_REPORT ``what`` to the origin; where to pull from now (after FAILED)."""
    body = wr.encode_report(reader.prefix, generation, reader.reader_id, what, upstream)
    answer = await reader._origin_call(Opcode.RELAY_REPORT, body, f"RELAY_REPORT {what.name}")
    placement = wr.decode_report_reply(answer)
    if what is wr.Report.FAILED and placement.reader == 0:
        reader.reader_id = 0  # no longer in the relay (the generation was retired): from the origin
    return placement
