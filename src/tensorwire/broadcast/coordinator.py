"""The origin's side of the relay: ``RelayCoordinator``, an ``Extension`` of the server that holds
the published tensors (``tensorwire serve`` adds it).

It serves four opcodes (docs/protocol.md §15):

- RELAY_JOIN: a reader asks for the newest generation of a prefix; the answer is its manifest
  (tensor records, chunk size, one checksum per chunk) and where to pull it from: the origin for
  the first reader of a chain, else the reader that joined before it (chains.py).
- RELAY_GET: chunks of a generation, served from the store; the bytes sent are counted per
  generation (``relay_stats``, the ``tensorwire_relay_served_bytes`` metric): what the origin's
  link carried for the relay.
- RELAY_REPORT: a reader is done (it stays an upstream for later readers), leaves, or could not
  read from its upstream (that one is dropped and the reader reads from the origin).
- RELAY_STATS: the table and the counts of one prefix as JSON.

Every request comes over a connection the server admitted: with a token configured, a reader that
does not present it never reaches these handlers, so it never joins a relay.

Identity: a registration belongs to the connection that joined (``RelaySession``, chains.py's
``Owner``): only a report over that connection speaks for it (one naming another connection's
reader is refused, counted in ``identity_refused`` and logged), and the registration goes when the
connection closes. The address a reader registers is checked against that connection: the same
scheme (a tls:// origin takes no tcp:// relay) and the very IP address it comes from (no reader
points the others at a third host, its loopback or a name), held by no other connection. Under
the server's own prefix (``_ps``, parameter-server relay pulls: ps/relay.py) only a connection the
parameter server admitted for that job (the PS_RELAY of one of its live workers) is registered;
anyone else (an observer, a stranger) reads from the origin and is nobody's upstream.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire.broadcast.chains import Chains, Generation, Owner, Reader
from tensorwire.broadcast.source import GenerationSource, Source
from tensorwire.errors import InvalidName, ProtocolError, VersionChanged
from tensorwire.logs import event
from tensorwire.server import Handler, Request, Server
from tensorwire.store.generations import SERVER_PREFIX
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode

MAX_GET_CHUNKS = 64  # chunks one RELAY_GET answer carries at most
MAX_GET_BYTES = 64 << 20  # and bytes
RELAY_SCHEMES = ("tcp", "tls")
MAX_ADMITTED = 16  # restricted prefixes one connection is admitted to relay under (the last ones)
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
log = logging.getLogger("tensorwire.broadcast")


@dataclass(eq=False)
class RelaySession(Owner):
    """One connection's part in the relay (``Request.session_state``): the readers it registered
    (``Owner``) and the restricted prefixes it was admitted to relay under. Its registrations go
    when the connection closes."""

    admitted: dict[str, None] = field(default_factory=dict)  # an ordered set, the newest last
    on_close: Callable[[Owner], None] | None = None

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close(self)


def relay_session(req: Request, chains: Chains) -> RelaySession:
    """The relay's state of ``req``'s connection (made on first use; dropped from ``chains`` when
    the connection closes)."""
    session = req.session_state(RelaySession)
    session.on_close = chains.drop_owner
    return session


def admit(req: Request, chains: Chains, prefix: str) -> None:
    """``req``'s connection may register readers under the restricted ``prefix`` (the parameter
    server admits a live worker's connection for its job's prefix)."""
    admitted = relay_session(req, chains).admitted
    admitted.pop(prefix, None)
    admitted[prefix] = None
    while len(admitted) > MAX_ADMITTED:
        del admitted[next(iter(admitted))]


def restricted(prefix: str) -> bool:
    """Whether relaying under ``prefix`` takes an admission: the server's own prefix."""
    return prefix == SERVER_PREFIX or prefix.startswith(SERVER_PREFIX + "/")


class RelayCoordinator:
    """The relay's coordinator on the origin (see the module docstring). ``source`` says where
    generations come from (source.py): ``RelayCoordinator.of(server)`` relays the server's published
    generations. ``chains`` bounds the tables."""

    def __init__(self, source: Source, chains: Chains | None = None) -> None:
        self.source = source
        self.chains = chains or Chains()
        self.identity_refused = 0  # reports naming a reader another connection registered
        self.unadmitted = 0  # joins under a restricted prefix read from the origin, unregistered

    @classmethod
    def of(cls, server: Server, chains: Chains | None = None) -> RelayCoordinator:
        """The coordinator of ``server``'s generations, added to it (``tensorwire serve`` does); the
        one it has already, if it has one (a ``ParamServer`` adds one for its relay pulls)."""
        for extension in server.extensions:
            if isinstance(extension, cls):
                return extension
        coordinator = cls(GenerationSource(server.generations), chains)
        server.extend(coordinator)
        return coordinator

    def frame_handlers(self) -> Mapping[int, Handler]:
        return {
            Opcode.RELAY_JOIN: self._on_join,
            Opcode.RELAY_GET: self._on_get,
            Opcode.RELAY_REPORT: self._on_report,
            Opcode.RELAY_STATS: self._on_stats,
        }

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    async def close(self) -> None:
        return None

    # -- metrics (server.metrics.Observed) --------------------------------------------------------
    def collectors(self) -> list[Any]:
        return [_Collector(self)]

    def status(self) -> dict[str, Any]:
        chains = self.chains
        relay = {"served_bytes": chains.totals(), "readers": chains.readers(),
                 "readers_by_prefix": chains.readers_by_prefix()}  # fmt: skip
        relay.update(identity_refused=self.identity_refused, unadmitted=self.unadmitted)
        return {"relay": relay}

    # -- handlers ------------------------------------------------------------------------------
    async def _on_join(self, req: Request) -> None:
        _no_data(req)
        prefix, after, relay = wr.decode_join(req.meta)
        session = relay_session(req, self.chains)
        if relay:
            check_relay_address(relay, req.transport, req.peer)
        manifest = await self.source.manifest(prefix)
        if manifest.generation == after:  # nothing newer: no manifest, no place in a relay
            await req.reply(
                wr.encode_join_reply(wr.Manifest(after, manifest.chunk_bytes, (), ()), wr.Placement(0, 0, ""))
            )
            return
        gen = self.chains.generation(prefix, manifest)
        if relay and restricted(prefix) and prefix not in session.admitted:
            relay = ""  # an observer or a stranger: it reads from the origin, nobody reads from it
            self.unadmitted += 1
        reader = self.chains.join(prefix, gen, relay, session)
        await req.reply(wr.encode_join_reply(manifest, gen.placement(reader)))

    async def _on_get(self, req: Request) -> None:
        _no_data(req)
        prefix, generation, first, count, _ = wr.decode_get(req.meta)
        gen = self.chains.find(prefix, generation)
        manifest = gen.manifest if gen is not None else await self._manifest_at(prefix, generation)
        index, offset, length = manifest.span(first, min(count, MAX_GET_CHUNKS, _chunks_in(manifest)))
        with self.source.read(prefix, manifest, index) as data:
            record = TensorMeta(manifest.metas[index].name, torch.uint8, (length,), length, generation)
            await req.reply(wm.encode_records([record]), [data[offset : offset + length]])
        self.chains.count_served(prefix, gen, length)

    async def _manifest_at(self, prefix: str, generation: int) -> wr.Manifest:
        manifest = await self.source.manifest(prefix)
        if manifest.generation != generation:
            raise VersionChanged(
                f"generation {generation} of {prefix!r} is retired; the newest is {manifest.generation}"
            )
        return manifest

    async def _on_report(self, req: Request) -> None:
        _no_data(req)
        prefix, generation, reader_id, what, upstream = wr.decode_report(req.meta)
        session = relay_session(req, self.chains)
        gen = self.chains.find(prefix, generation)
        reader = self.chains.owned(gen, reader_id, session) if gen is not None else None
        placement = wr.Placement(0, 0, "")  # not (or no longer) in the relay: read from the origin
        if gen is not None and reader is not None:
            placement = self._apply(prefix, gen, reader, what, upstream)
        elif gen is not None and reader_id in gen.readers:
            self._refuse_identity(req, prefix, reader_id, what)
        await req.reply(wr.encode_report_reply(placement))

    def _apply(
        self, prefix: str, gen: Generation, reader: Reader, what: wr.Report, upstream: int
    ) -> wr.Placement:
        if what is wr.Report.FAILED:
            return self.chains.failed(prefix, gen, reader, upstream)
        if what is wr.Report.DONE:
            reader.done = True
        elif what is wr.Report.LEAVE:
            self.chains.leave(gen, reader.id)
        return wr.Placement(0, 0, "")

    def _refuse_identity(self, req: Request, prefix: str, reader_id: int, what: wr.Report) -> None:
        """A report for a reader another connection registered: nothing changes; counted, logged."""
        self.identity_refused += 1
        event(log, logging.WARNING, "refused a relay report for another connection's reader", peer=req.peer,
              prefix=prefix, reader=reader_id, report=what.name, refused=self.identity_refused)  # fmt: skip
        raise ProtocolError(
            f"RELAY_REPORT {what.name} for reader {reader_id} of {prefix!r} refused: another connection "
            "registered it (a reader reports over the connection it joined on)"
        )

    async def _on_stats(self, req: Request) -> None:
        _no_data(req)
        prefix = wr.decode_stats(req.meta)
        doc = json.dumps(self.chains.stats(prefix)).encode()
        await req.reply(wr.encode_json(doc))


def _chunks_in(manifest: wr.Manifest) -> int:
    """Chunks of at most MAX_GET_BYTES."""
    return max(MAX_GET_BYTES // manifest.chunk_bytes, 1)


def check_relay_address(url: str, transport: str, peer: str) -> Address:
    """The address a reader advertises for its relay server, joining over a ``transport``
    connection from ``peer``: tcp:// or tls:// as that connection is (no plain text under a TLS
    origin), the IP address that connection comes from (not a name, nor anyone else's address: the
    origin hands it to other readers, who connect to it), a port in 1..65535. Anything else is
    refused (InvalidName)."""
    try:
        address = Address.parse(url)
    except ValueError as exc:
        raise InvalidName(f"relay address {url!r}: {exc}") from exc
    if address.scheme not in RELAY_SCHEMES:
        raise InvalidName(f"relay address {url!r}: the scheme must be one of {', '.join(RELAY_SCHEMES)}")
    if address.scheme != transport:
        raise InvalidName(
            f"relay address {url!r}: a reader joining over {transport}:// relays over {transport}://"
        )
    if not 1 <= address.port <= 65535:
        raise InvalidName(f"relay address {url!r}: the port must be in 1..65535")
    if not _valid_host(address.host):
        raise InvalidName(f"relay address {url!r}: {address.host!r} is not a host name or IP address")
    if _ip(address.host) is None or _ip(address.host) != _peer_ip(peer):
        raise InvalidName(
            f"relay address {url!r}: a reader registers the IP address its connection comes from"
            f" ({peer}), where its relay server listens (Subscriber(listen_host=...))"
        )
    return address


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (an IPv4-mapped IPv6 one as IPv4), None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _peer_ip(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address of a connection's ``peer`` ("tcp://HOST:PORT"), None when unknown."""
    host = peer.partition("://")[2].rpartition(":")[0]
    return _ip(host) if host else None


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(_HOST_LABEL.match(label) for label in labels)


def _no_data(req: Request) -> None:
    if req.header.data_len:
        raise ProtocolError(f"relay requests carry no data, but the frame has {req.header.data_len} bytes")


class _Collector:
    """``tensorwire_relay_served_bytes{prefix}``, ``tensorwire_relay_readers`` and
    ``tensorwire_relay_refused{reason}`` (reports for another connection's reader: "identity";
    joins under ``_ps`` not admitted: "unadmitted"), per scrape."""

    def __init__(self, coordinator: RelayCoordinator) -> None:
        self._coordinator = coordinator

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        chains = self._coordinator.chains
        served = CounterMetricFamily(
            "tensorwire_relay_served_bytes", "Bytes the origin sent to relay readers.", labels=["prefix"]
        )
        for prefix, nbytes in chains.totals().items():
            served.add_metric([prefix], nbytes)
        yield served
        yield GaugeMetricFamily("tensorwire_relay_readers", "Readers registered in relays.", chains.readers())
        refused = CounterMetricFamily(
            "tensorwire_relay_refused", "Relay requests refused or not registered.", labels=["reason"]
        )
        refused.add_metric(["identity"], self._coordinator.identity_refused)
        refused.add_metric(["unadmitted"], self._coordinator.unadmitted)
        yield refused
