"""Prometheus metrics of a server (``tensorwire serve --metrics-port PORT``).

The hot path only bumps plain integers (``RequestCounts``: one dict lookup and a few adds per
request, never per chunk, no lock: a server's requests all run on its event loop thread); the
numbers become Prometheus families when they are scraped (``ServerCollector``), in the exporter's
HTTP thread. Each server has its own ``CollectorRegistry``, so several servers in one process
(tests, ``ServerThread``) never share or clash over a metric.

Exported (counters end in ``_total``; ``op`` is the operation: put, get, ps_push, ...):

* ``tensorwire_requests_total``, ``tensorwire_received_bytes_total`` (request data),
  ``tensorwire_sent_bytes_total`` (response data), ``tensorwire_request_errors_total``: by ``op``
  and ``transport`` (tcp, tls, memory, grpc, ...).
* ``tensorwire_request_duration_seconds``: histogram of the time a request took to serve (its
  frame read to its answer sent), by ``op`` and ``transport``, in ``LATENCY_BUCKETS`` (the
  dashboard's latency percentiles; long-polls such as a generation wait count their wait).
* ``tensorwire_requests_in_flight``, ``tensorwire_connections`` (gauges);
  ``tensorwire_connections_refused_total`` by ``reason``: limit (``--max-connections``), auth (a
  missing or wrong token, on a connection or a gRPC call), auth_timeout (no authenticated first
  frame within ``--auth-timeout``), metrics_limit (a scrape over ``--metrics-connections``),
  metrics_auth (a scrape whose bearer is not ``--metrics-token-file``'s), rdma_silent and
  rdma_limit (connections to the RDMA engine's ports shut down: silent past their grace, or over
  ``--max-connections``).
* ``tensorwire_checksum_failures_total`` by ``transport``: data chunks that failed their checksum.
* ``tensorwire_upload_resumes_total``: resumable puts resumed after a break (client retries the
  server sees; resent parameter-server pushes are ``tensorwire_ps_duplicate_pushes_total``).
* ``tensorwire_store_bytes``, ``tensorwire_store_reserved_bytes`` (puts in flight),
  ``tensorwire_store_capacity_bytes``, ``tensorwire_store_tensors`` (gauges);
  ``tensorwire_store_used_bytes`` (what counts against the capacity), of which
  ``tensorwire_store_metadata_bytes`` (stored names' cost), ``tensorwire_store_pinned_bytes`` (old
  versions readers still hold), ``tensorwire_store_scratch_bytes`` (decoding scratch) and
  ``tensorwire_store_charged_bytes`` by ``kind`` (what the parameter server's jobs, ``ps.params``,
  ``ps.gradients``, ..., and the gradient exchange, ``exchange``, hold in the one capacity).
* ``tensorwire_uploads_open`` (gauge) and ``tensorwire_uploads_dropped_total`` by ``reason``
  (replaced, expired, refused; unslotted: small resumable puts served without upload state).
* ``tensorwire_server_info`` (1, labelled ``version`` and ``addresses``), and prometheus-client's
  ``process_*`` families (CPU seconds, resident memory, open files).

A parameter server adds the ``tensorwire_ps_*`` families of ``tensorwire.ps.metrics``.

No label takes a value a peer chose: ``op`` is the name of a known operation or "unknown" (a
made-up opcode or gRPC method), and ``transport``, ``reason`` and ``role`` come from fixed sets,
so a peer cannot add series. The HTTP endpoint serves at most ``max_connections`` scrapes at a
time (one thread each) and drops a connection that does not send its request, or take its answer,
within ``timeout`` seconds.

Who sees which label values (a job id, a generation prefix: a client's choice): metrics_views.py.
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from tensorwire.server.metrics_views import (
    PSEUDONYM_PREFIX,
    SERVER_LABELS,
    Views,
    metrics_app,
    pseudonym,
    pseudonym_key,
    unmask,
)
from tensorwire.wire.frame import Opcode

log = logging.getLogger("tensorwire.server.metrics")

if TYPE_CHECKING:
    from prometheus_client.registry import Collector, CollectorRegistry

    from tensorwire.store import TensorStore
    from tensorwire.store.uploads import Uploads
    from tensorwire.types import Address

METRICS_PATH = "/metrics"
_OPS = {int(op): op.name.lower() for op in Opcode}
# Upper bounds (seconds) of the latency histogram's buckets: 100 µs (a small get on loopback) to 10 s.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)  # fmt: skip


def op_name(opcode: int) -> str:
    return _OPS.get(opcode, "unknown")


@dataclass(slots=True)
class Row:
    """The counts of one (operation, transport)."""

    requests: int = 0
    received: int = 0
    sent: int = 0
    errors: int = 0
    # Requests timed, per LATENCY_BUCKETS bound (not cumulative; the last slot: above them all).
    latency: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    seconds: float = 0.0  # the sum of the timed requests' durations


@dataclass(eq=False)
class RequestCounts:
    """What the serving code counts, as plain integers (read when scraped)."""

    rows: dict[tuple[str, str], Row] = field(default_factory=dict)
    in_flight: int = 0
    connections: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    checksum_failures: dict[str, int] = field(default_factory=dict)
    upload_resumes: int = 0

    def row(self, op: str, transport: str) -> Row:
        row = self.rows.get((op, transport))
        if row is None:
            row = self.rows[(op, transport)] = Row()
        return row

    def begin(self, op: str, transport: str, received: int = 0) -> Row:
        """A request starts: counted, with the ``received`` bytes its header announces, and in flight
        until ``end``. The bytes are counted here, before any answer leaves, so that a client that has
        its answer reads them in the metrics."""
        row = self.rows.get((op, transport)) or self.row(op, transport)
        row.requests += 1
        row.received += received
        self.in_flight += 1
        return row

    def end(self, row: Row, sent: int, failed: bool, seconds: float | None = None) -> None:
        """The request is done; ``seconds``, when the caller timed it, goes into the latency histogram."""
        row.sent += sent
        row.errors += failed
        self.in_flight -= 1
        if seconds is not None:
            row.latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            row.seconds += seconds

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def checksum_failed(self, transport: str) -> None:
        self.checksum_failures[transport] = self.checksum_failures.get(transport, 0) + 1


@runtime_checkable
class Observed(Protocol):
    """An extension (the parameter server) that adds metrics and a part to the STATUS answer."""

    def collectors(self) -> list[Collector]: ...

    def status(self) -> dict[str, Any]: ...


class Scraped(Protocol):
    """What a scrape reads of a server (``core.Server`` is one), from the exporter's thread."""

    @property
    def counts(self) -> RequestCounts: ...

    @property
    def store(self) -> TensorStore: ...

    @property
    def uploads(self) -> Uploads: ...

    @property
    def exporter(self) -> Exporter | None: ...

    @property
    def addresses(self) -> list[Address]: ...


class ServerCollector:
    """The server's counts, store and identity as Prometheus families, built at each scrape."""

    def __init__(self, server: Scraped) -> None:
        self._server = server

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        server = self._server
        counts = server.counts
        rows = list(counts.rows.items())  # a copy: the loop thread may add a row meanwhile
        for name, doc, attr in (
            ("requests", "Requests served, by operation and transport.", "requests"),
            ("received_bytes", "Request data bytes received.", "received"),
            ("sent_bytes", "Response data bytes sent.", "sent"),
            ("request_errors", "Requests answered with an error.", "errors"),
        ):
            family = CounterMetricFamily(f"tensorwire_{name}", doc, labels=["op", "transport"])
            for (op, transport), row in rows:
                family.add_metric([op, transport], getattr(row, attr))
            yield family
        yield _latency(rows)
        refused, corrupt = dict(counts.refused), counts.checksum_failures
        exporter = server.exporter
        if exporter is not None and exporter.refused:
            refused["metrics_limit"] = exporter.refused
        if exporter is not None and exporter.refused_bearers:
            refused["metrics_auth"] = exporter.refused_bearers
        yield _labelled("tensorwire_connections_refused", "Connections refused.", "reason", refused)
        yield _labelled("tensorwire_checksum_failures", "Corrupt chunks.", "transport", corrupt)
        yield CounterMetricFamily(
            "tensorwire_upload_resumes", "Resumable puts resumed after a break.", value=counts.upload_resumes
        )
        yield GaugeMetricFamily("tensorwire_requests_in_flight", "Requests being served.", counts.in_flight)
        yield GaugeMetricFamily("tensorwire_connections", "Open connections.", counts.connections)
        store = server.store
        yield GaugeMetricFamily("tensorwire_store_bytes", "Bytes stored.", store.stored)
        yield GaugeMetricFamily("tensorwire_store_reserved_bytes", "Bytes of puts in flight.", store.reserved)
        yield GaugeMetricFamily("tensorwire_store_capacity_bytes", "The store's capacity.", store.capacity)
        yield GaugeMetricFamily("tensorwire_store_tensors", "Tensors stored.", len(store))
        yield GaugeMetricFamily("tensorwire_store_used_bytes", "What counts against capacity.", store.used)
        yield GaugeMetricFamily("tensorwire_store_metadata_bytes", "Stored names' cost.", store.metadata)
        yield GaugeMetricFamily("tensorwire_store_pinned_bytes", "Old versions readers hold.", store.pinned)
        yield GaugeMetricFamily("tensorwire_store_scratch_bytes", "Decoding scratch.", store.scratch_bytes)
        charged = GaugeMetricFamily(
            "tensorwire_store_charged_bytes", "What the PS and the exchange hold.", labels=["kind"]
        )
        for kind, nbytes in store.charged.items():  # kinds are the code's names (ps.params, exchange)
            charged.add_metric([kind], nbytes)
        yield charged
        uploads = server.uploads
        yield GaugeMetricFamily("tensorwire_uploads_open", "Open resumable or striped uploads.", len(uploads))
        dropped = {k: getattr(uploads.counts, k) for k in ("replaced", "expired", "refused", "unslotted")}
        yield _labelled("tensorwire_uploads_dropped", "Uploads dropped or refused.", "reason", dropped)
        info = GaugeMetricFamily("tensorwire_server_info", "This server.", labels=["version", "addresses"])
        info.add_metric([package_version(), ",".join(str(a) for a in server.addresses)], 1)
        yield info


def _latency(rows: list[tuple[tuple[str, str], Row]]) -> Any:
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(
        "tensorwire_request_duration_seconds", "Time to serve a request.", labels=["op", "transport"]
    )
    bounds = [*(repr(b) for b in LATENCY_BUCKETS), "+Inf"]
    for (op, transport), row in rows:
        counts, total = list(row.latency), 0
        cumulative = []
        for bound, n in zip(bounds, counts, strict=True):
            total += n
            cumulative.append((bound, total))
        family.add_metric([op, transport], cumulative, row.seconds)
    return family


def _labelled(name: str, doc: str, label: str, values: dict[str, int]) -> Any:
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in list(values.items()):
        family.add_metric([key], value)
    return family


def package_version() -> str:
    """The installed tensorwire's version (not the package's ``__version__``: the package root
    imports the client and the server, and this module is part of the server)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensorwire")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def build_registry(server: Scraped, extra: Iterable[Collector] = ()) -> CollectorRegistry:
    """A registry of its own for ``server``: its collector, the process's, and ``extra``."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server))
    ProcessCollector(registry=registry)
    for collector in extra:
        registry.register(collector)
    return registry


class _Handler(WSGIRequestHandler):
    """One scrape, whose socket times out; it logs nothing."""

    server: _BoundedServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.read_timeout)

    def log_message(self, format: str, *args: Any) -> None:
        return None


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, as prometheus-client's own server, but at most ``slots`` of them:
    a connection beyond that is closed at once (and counted in ``refused``)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: connections over the limit are closed, not left queued

    def __init__(self, address: tuple[str, int], family: int, slots: int, timeout: float) -> None:
        self.address_family = family
        self.read_timeout = timeout
        self.refused = 0
        self._slots = threading.BoundedSemaphore(slots)
        self._limit = slots
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1  # one accept thread: no race
            if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs ~log2(n) lines
                log.warning("metrics endpoint refused %s: %d scrapes at once already (--metrics-connections);"
                            " %d refused so far", client_address[0], self._limit, self.refused)  # fmt: skip
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A scrape that timed out or went away: not worth the traceback socketserver prints."""
        log.debug("metrics request from %s failed", client_address, exc_info=True)


class Exporter:
    """The HTTP endpoint Prometheus scrapes (``http://host:port/metrics``), in a daemon thread:
    at most ``max_connections`` at a time, each dropped if silent or unread for ``timeout`` s.

    ``private``: the server asks its clients for a token or a certificate, so a scrape sees
    client-chosen label values only as pseudonyms under ``key`` unless it bears ``scrape_token``
    (the metrics token; given alone, it makes the page private too). ``key`` defaults to one
    derived from ``scrape_token`` (``pseudonym_key``); ``key`` is None for an open page."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        max_connections: int = 16,
        timeout: float = 5.0,
        *,
        scrape_token: str | None = None,
        private: bool = False,
        key: str | None = None,
    ) -> None:
        if scrape_token is not None and not scrape_token:
            raise ValueError("an empty metrics token would let nobody in (or, read carelessly, everyone)")
        self.host = host
        self.key = (key or pseudonym_key(scrape_token)) if private or scrape_token else None
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        server = _BoundedServer((str(sockaddr[0]), port), family, max_connections, timeout)
        app = metrics_app(registry, scrape_token, self.key)
        self._views = app if isinstance(app, Views) else None
        server.set_app(app)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="tensorwire-metrics", daemon=True)
        self._thread.start()
        self.port: int = server.server_port

    @property
    def refused(self) -> int:
        """Connections closed at once because ``max_connections`` were open."""
        return self._server.refused

    @property
    def refused_bearers(self) -> int:
        """Scrapes refused (401) for a bearer that is not the metrics token."""
        return self._views.refused if self._views is not None else 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{METRICS_PATH}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A scraped page, by sample name: [(labels, value), ...] (``tensorwire status`` reads it)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


__all__ = [
    "Exporter",
    "LATENCY_BUCKETS",
    "Observed",
    "PSEUDONYM_PREFIX",
    "RequestCounts",
    "Row",
    "SERVER_LABELS",
    "Scraped",
    "ServerCollector",
    "build_registry",
    "metrics_app",
    "op_name",
    "package_version",
    "parse",
    "pseudonym",
    "pseudonym_key",
    "unmask",
]
