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
  read from its upstream (that one is dropped and the reader gets a new upstream).
- RELAY_STATS: the table and the counts of one prefix as JSON.

Every request comes over a connection the server admitted: with a token configured, a reader that
does not present it never reaches these handlers, so it never joins a relay.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tensorwire.broadcast.chains import Chains, Generation
from tensorwire.broadcast.source import GenerationSource, Source
from tensorwire.errors import InvalidName, ProtocolError, VersionChanged
from tensorwire.server import Handler, Request, Server
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode

MAX_GET_CHUNKS = 64  # chunks one RELAY_GET answer carries at most
MAX_GET_BYTES = 64 << 20  # and bytes
RELAY_SCHEMES = ("tcp", "tls")
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


class RelayCoordinator:
    """The relay's coordinator on the origin (see the module docstring). ``source`` says where
    generations come from (source.py): ``RelayCoordinator.of(server)`` relays the server's published
    generations. ``chains`` bounds the tables."""

    def __init__(self, source: Source, chains: Chains | None = None) -> None:
        self.source = source
        self.chains = chains or Chains()

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
        return [_Collector(self.chains)]

    def status(self) -> dict[str, Any]:
        chains = self.chains
        return {"relay": {"served_bytes": chains.totals(), "readers": chains.readers(),
                          "readers_by_prefix": chains.readers_by_prefix()}}  # fmt: skip

    # -- handlers ------------------------------------------------------------------------------
    async def _on_join(self, req: Request) -> None:
        _no_data(req)
        prefix, after, relay = wr.decode_join(req.meta)
        if relay:
            check_relay_address(relay)
        manifest = await self.source.manifest(prefix)
        if manifest.generation == after:  # nothing newer: no manifest, no place in a relay
            await req.reply(
                wr.encode_join_reply(wr.Manifest(after, manifest.chunk_bytes, (), ()), wr.Placement(0, 0, ""))
            )
            return
        gen = self.chains.generation(prefix, manifest)
        reader = self.chains.join(prefix, gen, relay)
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
        gen = self.chains.find(prefix, generation)
        placement = wr.Placement(0, 0, "")
        if gen is not None:
            placement = self._apply(gen, reader_id, what, upstream)
        await req.reply(wr.encode_report_reply(placement))

    def _apply(self, gen: Generation, reader_id: int, what: wr.Report, upstream: int) -> wr.Placement:
        if what is wr.Report.FAILED:
            return self.chains.failed(gen, reader_id, upstream)
        if what is wr.Report.DONE and reader_id in gen.readers:
            gen.readers[reader_id].done = True
        elif what is wr.Report.LEAVE:
            self.chains.leave(gen, reader_id)
        return wr.Placement(0, 0, "")

    async def _on_stats(self, req: Request) -> None:
        _no_data(req)
        prefix = wr.decode_stats(req.meta)
        doc = json.dumps(self.chains.stats(prefix)).encode()
        await req.reply(wr.encode_json(doc))


def _chunks_in(manifest: wr.Manifest) -> int:
    """Chunks of at most MAX_GET_BYTES."""
    return max(MAX_GET_BYTES // manifest.chunk_bytes, 1)


def check_relay_address(url: str) -> Address:
    """The address a reader advertises for its relay server: tcp:// or tls://, a host name made of
    valid labels or an IP address, a port in 1..65535. Anything else is refused (InvalidName): the
    origin hands it to other readers, who connect to it."""
    try:
        address = Address.parse(url)
    except ValueError as exc:
        raise InvalidName(f"relay address {url!r}: {exc}") from exc
    if address.scheme not in RELAY_SCHEMES:
        raise InvalidName(f"relay address {url!r}: the scheme must be one of {', '.join(RELAY_SCHEMES)}")
    if not 1 <= address.port <= 65535:
        raise InvalidName(f"relay address {url!r}: the port must be in 1..65535")
    if not _valid_host(address.host):
        raise InvalidName(f"relay address {url!r}: {address.host!r} is not a host name or IP address")
    return address


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
    """``tensorwire_relay_served_bytes{prefix}`` and ``tensorwire_relay_readers``, per scrape."""

    def __init__(self, chains: Chains) -> None:
        self._chains = chains

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        served = CounterMetricFamily(
            "tensorwire_relay_served_bytes", "Bytes the origin sent to relay readers.", labels=["prefix"]
        )
        for prefix, nbytes in self._chains.totals().items():
            served.add_metric([prefix], nbytes)
        yield served
        yield GaugeMetricFamily(
            "tensorwire_relay_readers", "Readers registered in relays.", self._chains.readers()
        )
