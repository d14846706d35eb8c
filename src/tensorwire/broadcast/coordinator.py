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
scheme (a tls:// origin takes no tcp:// relay), an IP address (no name), never a loopback, link-
local, multicast or unspecified one (unless the origin itself listens on loopback only: every
reader is then on this host), and the very IP the connection comes from, or one inside the
operator's ``networks`` (``tensorwire serve --relay-networks``: readers behind NAT, or relaying on
another interface than the one they reach the origin from); no other connection may hold it. Under
the server's own prefix (``_ps``, parameter-server relay pulls: ps/server/relay.py) only a parameter-server
session the server admitted for that job (the PS_RELAY of one of its live workers, naming its
incarnation, which the join carries) is registered; anyone else (an observer, a stranger) reads
from the origin and is nobody's upstream.

A join whose address is refused, whose session is not admitted, or for which no relay table may
be made (chains.py) is not an error: the reader is answered the origin as its upstream and reads
from it, unregistered (counted in ``unadmitted`` and ``tensorwire_relay_refused{reason}``, logged
the 1st, 2nd, 4th... time), so a multi-homed reader or one behind NAT still gets its generation.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorwire.broadcast.chains import Chains, Generation, Owner, Reader
from tensorwire.broadcast.source import GenerationSource, Source
from tensorwire.errors import InvalidName, ProtocolError
from tensorwire.logs import event
from tensorwire.security import is_loopback
from tensorwire.server import Handler, Request, Server
from tensorwire.store.generation_config import is_server_prefix
from tensorwire.store.uploads import client_of
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode

MAX_GET_CHUNKS = 64  # chunks one RELAY_GET answer carries at most
MAX_GET_BYTES = 64 << 20  # and bytes
RELAY_SCHEMES = ("tcp", "tls")
MAX_NETWORKS = 64  # --relay-networks entries
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
log = logging.getLogger("tensorwire.broadcast")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(eq=False)
class RelaySession(Owner):
    """One connection's part in the relay (``Request.session_state``): the readers it registered
    (``Owner``). Its registrations go when the connection closes."""

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


def restricted(prefix: str) -> bool:
    """Whether relaying under ``prefix`` takes an admission: the server's own prefix."""
    return is_server_prefix(prefix)


class RelayCoordinator:
    """The relay's coordinator on the origin (see the module docstring). ``source`` says where
    generations come from (source.py): ``RelayCoordinator.of(server)`` relays the server's published
    generations. ``chains`` bounds the tables. ``networks`` (CIDRs, ``--relay-networks``): where a
    reader may register a relay address other than the IP its connection comes from."""

    def __init__(self, source: Source, chains: Chains | None = None, *, networks: Iterable[str] = ()) -> None:
        self.source = source
        self.chains = chains or Chains()
        self.networks = parse_networks(networks)
        self.identity_refused = 0  # reports naming a reader another connection registered
        self.unadmitted = 0  # joins that offered an address and read from the origin, unregistered
        self.unadmitted_by = Counter[str]()  # ... by reason: "address", "session", "tables"
        self._listening: Callable[[], Sequence[Address]] = lambda: ()

    @classmethod
    def of(
        cls, server: Server, chains: Chains | None = None, *, networks: Iterable[str] = ()
    ) -> RelayCoordinator:
        """The coordinator of ``server``'s generations, added to it (``tensorwire serve`` does); the
        one it has already, if it has one (a ``ParamServer`` adds one for its relay pulls), which
        then takes ``networks`` too."""
        for extension in server.extensions:
            if isinstance(extension, cls):
                extension.networks += parse_networks(networks)
                return extension
        coordinator = cls(GenerationSource(server.generations), chains, networks=networks)
        server.extend(coordinator)
        return coordinator

    def added_to(self, server: Any) -> None:
        """Its server (``Server.extend``): whose listeners say whether every reader is on this host."""
        self._listening = lambda: server.addresses

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
        relay.update(identity_refused=self.identity_refused, unadmitted=self.unadmitted,
                     unadmitted_by_reason=dict(self.unadmitted_by))  # fmt: skip
        return {"relay": relay}

    # -- handlers ------------------------------------------------------------------------------
    async def _on_join(self, req: Request) -> None:
        _no_data(req)
        prefix, after, relay, session = wr.decode_join(req.meta)
        owner = relay_session(req, self.chains)
        manifest = await self.source.manifest(prefix)
        if manifest.generation == after:  # nothing newer: no manifest, no place in a relay
            await req.reply(
                wr.encode_join_reply(wr.Manifest(after, manifest.chunk_bytes, (), ()), wr.Placement(0, 0, ""))
            )
            return
        relay = self._admissible(req, prefix, relay, session)
        gen = self.chains.generation(prefix, manifest, make=bool(relay))
        if gen is None and relay:
            full = f"each of the {self.chains.max_prefixes} relay tables has readers"
            self._unadmitted(req, prefix, "tables", full)
        reader = self.chains.join(prefix, gen, relay, owner) if gen is not None else None
        placement = gen.placement(reader) if gen is not None else wr.Placement(0, 0, "")
        await req.reply(wr.encode_join_reply(manifest, placement))

    def _admissible(self, req: Request, prefix: str, relay: str, session: int) -> str:
        """``relay`` if the reader may register it (see the module docstring), else "" (it reads
        from the origin, unregistered; counted and logged)."""
        if not relay:
            return ""
        local = self._loopback_only(req.transport)
        try:
            check_relay_address(relay, req.transport, req.peer, networks=self.networks, loopback=local)
        except InvalidName as exc:
            self._unadmitted(req, prefix, "address", str(exc))
            return ""
        if restricted(prefix) and not self.chains.admitted(prefix, session):
            self._unadmitted(req, prefix, "session", "no live worker's session of the job was named")
            return ""  # an observer or a stranger: it reads from the origin, nobody reads from it
        return relay

    def _loopback_only(self, scheme: str) -> bool:
        """Whether the origin listens on ``scheme`` on loopback only (every such reader is local)."""
        hosts = [a.host for a in self._listening() if a.scheme == scheme]
        return bool(hosts) and all(is_loopback(host) for host in hosts)

    def _unadmitted(self, req: Request, prefix: str, reason: str, why: str) -> None:
        self.unadmitted += 1
        self.unadmitted_by[reason] += 1
        if self.unadmitted & (self.unadmitted - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs ~log2(n)
            event(log, logging.WARNING, "relay join read from the origin, unregistered", peer=req.peer,
                  prefix=prefix, reason=reason, why=why, unadmitted=self.unadmitted)  # fmt: skip

    async def _on_get(self, req: Request) -> None:
        _no_data(req)
        prefix, generation, first, count, _ = wr.decode_get(req.meta)
        gen = self.chains.find(prefix, generation)
        manifest = gen.manifest if gen is not None else await self.source.manifest_of(prefix, generation)
        index, offset, length = manifest.span(first, min(count, MAX_GET_CHUNKS, _chunks_in(manifest)))
        with self.source.read(prefix, manifest, index) as data:
            record = TensorMeta(manifest.metas[index].name, torch.uint8, (length,), length, generation)
            await req.reply(wm.encode_records([record]), [data[offset : offset + length]])
        self.chains.count_served(prefix, gen, length)

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


def check_relay_address(
    url: str, transport: str, peer: str, *, networks: Sequence[IPNetwork] = (), loopback: bool = False
) -> Address:
    """The address a reader advertises for its relay server, joining over a ``transport``
    connection from ``peer``: tcp:// or tls:// as that connection is (no plain text under a TLS
    origin), an IP address that is not loopback (unless ``loopback``: the origin listens on loopback
    only), link-local, multicast or unspecified, and the one that connection comes from or one in
    ``networks`` (not a name, nor anyone else's address: the origin hands it to other readers, who
    connect to it), a port in 1..65535. Anything else is refused (InvalidName)."""
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
    ip = _ip(address.host)
    if ip is None or _unreachable(ip, loopback):
        raise InvalidName(
            f"relay address {url!r}: not an IP address other readers reach it at (a name, a loopback,"
            " link-local, multicast or unspecified address)"
        )
    if ip != _peer_ip(peer) and not any(ip in network for network in networks):
        raise InvalidName(
            f"relay address {url!r}: a reader registers the IP address its connection comes from"
            f" ({peer}), or one in the origin's --relay-networks"
        )
    return address


def _unreachable(ip: IPAddress, loopback: bool) -> bool:
    """Whether other readers cannot (or must not be sent to) reach ``ip``."""
    return ip.is_unspecified or ip.is_multicast or ip.is_link_local or (ip.is_loopback and not loopback)


def parse_networks(networks: Iterable[str]) -> list[IPNetwork]:
    """``--relay-networks`` CIDRs; ValueError naming the flag for one that is not."""
    parsed = []
    for text in networks:
        try:
            parsed.append(ipaddress.ip_network(str(text).strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"--relay-networks {text!r}: {exc}") from exc
    if len(parsed) > MAX_NETWORKS:
        raise ValueError(f"--relay-networks names {len(parsed)} networks, at most {MAX_NETWORKS}")
    return parsed


def _ip(host: str) -> IPAddress | None:
    """``host`` as an IP address (an IPv4-mapped IPv6 one as IPv4), None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _peer_ip(peer: str) -> IPAddress | None:
    """The IP address of a connection's ``peer`` ("tcp://HOST:PORT"), None when unknown."""
    return _ip(client_of(peer))


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
    joins read from the origin unregistered: an address refused, "address"; under ``_ps`` with no
    admitted session, "session"; no room for a relay table, "tables"), per scrape."""

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
        for reason in ("address", "session", "tables"):
            refused.add_metric([reason], self._coordinator.unadmitted_by[reason])
        yield refused
