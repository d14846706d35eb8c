"""Ask every server of a cluster its STATUS and scrape its metrics: ``tensorwire status`` prints
what this collects, ``tensorwire dashboard`` shows it live (``tensorwire.dashboard.view``).

For every server URL (``tcp://``, ``tls://``, ``memory://``; ``a|b`` lists the replicas of one
slot, each shown) ``probe`` asks STATUS (docs/protocol.md §11.9) and then scrapes the metrics
endpoint that answer names (``--metrics-port`` of the server). Whether a server can be asked
STATUS is asked of the connection (a ``FrameChannel``); one that cannot (gRPC) is pinged instead.
A URL ``http://host:port/metrics`` is scraped alone (a gRPC-only server, or a server reached only
through its metrics). Everything runs at once, each wait bounded by ``timeout`` and each server's
whole probe by ``DEADLINE_FACTOR`` times it (a server that answers each read just in time cannot
stretch it): a server that is down is a ``Node`` that says why, within that time; a probe never
raises, nor holds up the others.

A server that asks for a token or a client certificate shows a scrape without its metrics token
(this one: no secret goes to the metrics URL a server reports) every client-chosen label value as
a pseudonym (``server.metrics``); ``probe`` puts back those of the job ids and prefixes its STATUS
names, under the key the (authenticated) STATUS answer carries (``metrics_key``, taken out of the
answer so that no screen or JSON shows it; ``metrics.unmask``).

What a server answers is untrusted: the metrics URL it reports is scraped only if it is plain
``http(s)://host:port/...`` (never ``file://`` or another scheme; redirects are not followed), the
page is read up to ``MAX_METRICS_BYTES``, and every STATUS field ``summary`` reads is type-checked.
Escaping strings for where they are shown (a terminal, a web page) is the showing side's job.

(Moved here from ``tensorwire.cli.status``, which re-exports it: the dashboard sits below the CLI,
whose ``serve --dashboard-port`` starts it.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorwire import transport as transports
from tensorwire._aio import within
from tensorwire.client.core import ClientOptions
from tensorwire.client.options import transport_options
from tensorwire.errors import TensorwireError
from tensorwire.server import metrics
from tensorwire.transport.base import FrameChannel
from tensorwire.types import Address
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

DEFAULT_TIMEOUT = 2.0
DEADLINE_FACTOR = 3  # one server's whole probe (connect, STATUS, scrape) ends within this x timeout
MAX_METRICS_BYTES = 16 << 20  # a metrics page read beyond this is refused, not held in memory
MAX_UNMASKED = 4096  # label values taken from a STATUS answer to put back into its metrics
MAX_KEY_CHARS = 256  # a pseudonym key longer than this in a STATUS answer is ignored
METRICS_SCHEMES = ("http", "https")
Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass
class Node:
    """What is known about one server: its STATUS answer and its scraped metrics, or why not."""

    url: str
    status: dict[str, Any] | None = None
    error: str | None = None
    metrics_url: str | None = None
    samples: Samples = field(default_factory=dict)
    metrics_error: str | None = None
    answered: bool = False  # a gRPC server answered a ping (it has no STATUS call)
    metrics_key: str | None = field(default=None, repr=False)  # its pseudonyms' key (STATUS), never shown

    @property
    def up(self) -> bool:
        return self.status is not None or self.answered or (self.error is None and bool(self.samples))

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of the samples of ``name`` whose labels include ``labels`` (None: no sample)."""
        found = [v for have, v in self.samples.get(name, []) if labels.items() <= have.items()]
        return sum(found) if found else None

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "up": self.up, "error": self.error, "status": self.status,
                "metrics_url": self.metrics_url, "metrics_error": self.metrics_error,
                "summary": summary(self)}  # fmt: skip


def split_urls(urls: Sequence[str]) -> list[str]:
    """``tcp://a|b:7070,tcp://c`` -> each URL once, in order (``HOST:PORT`` means tcp://)."""
    seen: dict[str, None] = {}
    for text in urls:
        for url in (u.strip() for u in text.replace("|", ",").split(",")):
            if url:
                seen.setdefault(url if "://" in url else f"tcp://{url}", None)
    return list(seen)


async def ask_status(url: str, options: ClientOptions) -> dict[str, Any]:
    """The server's STATUS answer (TensorwireError when it cannot be had within the timeouts)."""
    conn = await transports.open_channel(url, transport_options(options), what="STATUS")
    try:
        return await _status(conn, url)
    finally:
        await conn.close()


async def _status(conn: FrameChannel, url: str) -> dict[str, Any]:
    reader = await conn.call(Opcode.STATUS, b"", what=f"STATUS of {url}")
    doc = json.loads(wps.decode_stats(reader))
    if not isinstance(doc, dict):
        raise ValueError(f"the STATUS answer of {url} is not a JSON object")
    return doc


async def status_or_ping(url: str, options: ClientOptions) -> dict[str, Any] | None:
    """STATUS where the connection carries it (a ``FrameChannel``); else (gRPC has no STATUS call)
    a ping, since whether the server answers is what there is to know: None."""
    conn = await transports.open_transport(Address.parse(url), transport_options(options))
    try:
        if isinstance(conn, FrameChannel):
            return await _status(conn, url)
        await conn.ping()
        return None
    finally:
        await conn.close()


def answers(url: str, options: ClientOptions) -> dict[str, Any] | None:
    """``tensorwire probe``: the server's STATUS answer (None: a gRPC server answered a ping),
    all within ``options.timeout``; else the TensorwireError that says why (TransferTimeout names
    the wait; AuthenticationError a refused token; ConnectError a server that is down)."""
    from tensorwire._aio import asyncio_timeout, run

    async def ask() -> dict[str, Any] | None:
        async with asyncio_timeout(options.timeout, f"{url} to answer STATUS"):
            return await status_or_ping(url, options)

    return run(ask())


def check_metrics_url(url: object) -> str:
    """``url`` if it is one to scrape: ``http(s)://host[:port]/path``, no credentials, no control
    characters; ValueError otherwise (a server reports it: it must not make us open a file)."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or not url.isprintable() or " " in url or len(url) > 2048:
        raise ValueError(f"{str(url)[:200]!r} is not a metrics URL")
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"{url!r} has a bad port: {exc}") from None
    if parts.scheme not in METRICS_SCHEMES or not parts.hostname or "@" in parts.netloc:
        raise ValueError(f"{url!r} is not a plain http(s)://host:port/... metrics URL")
    return url


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A metrics endpoint answers its own URL: a redirect (maybe to ftp:// or elsewhere) is an error."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def scrape(url: str, timeout: float) -> Samples:
    """GET a metrics page and parse it (OSError / ValueError when that fails); only http(s) URLs,
    no redirects, at most MAX_METRICS_BYTES."""
    opener = urllib.request.build_opener(_NoRedirects)
    with opener.open(check_metrics_url(url), timeout=timeout) as answer:
        body = answer.read(MAX_METRICS_BYTES + 1)
    if len(body) > MAX_METRICS_BYTES:
        raise ValueError(f"the metrics page at {url} is larger than {MAX_METRICS_BYTES} bytes")
    try:
        return metrics.parse(body.decode())
    except Exception as exc:  # the parser's own errors, for any malformed page
        raise ValueError(f"{url} is not a Prometheus metrics page ({type(exc).__name__}: {exc})") from exc


async def _in_daemon_thread(fn: Callable[[], Samples]) -> Samples:
    """``fn()`` on a daemon thread: urllib cannot be cancelled, so a scrape that outlives the
    deadline is abandoned (it cannot hold up the command, nor its exit) rather than awaited."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Samples] = loop.create_future()

    def settle(result: Samples | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result or {})

    def target() -> None:
        result: Samples | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for this scrape
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="tensorwire-scrape", daemon=True).start()
    return await future


async def probe(url: str, options: ClientOptions) -> Node:
    """The node of ``url``, within ``DEADLINE_FACTOR`` x the timeout whatever the server does."""
    node = Node(url)
    deadline = DEADLINE_FACTOR * options.timeout
    try:
        await within(_probe(node, options), deadline)
    except TimeoutError:
        why = f"no complete answer within {deadline:.3g}s (--timeout {options.timeout:g} x {DEADLINE_FACTOR})"
        if node.status is None and not node.answered:
            node.error = why
        else:
            node.metrics_error = why
    return node


async def _probe(node: Node, options: ClientOptions) -> Node:
    if node.url.startswith(("http://", "https://")):
        node.metrics_url = node.url  # given by the user, but checked the same way below
    elif not await _ask(node, options):
        return node
    if node.metrics_url:
        target = node.metrics_url
        try:
            scraped = await _in_daemon_thread(lambda: scrape(target, options.timeout))
            node.samples = metrics.unmask(scraped, node.metrics_key, named(node.status))
        except (OSError, ValueError) as exc:
            node.metrics_error = str(exc) or type(exc).__name__
            if node.status is None:
                node.error = f"metrics: {node.metrics_error}"
    return node


async def _ask(node: Node, options: ClientOptions) -> bool:
    """Ask the server its STATUS (or, without it, a ping) and note the metrics URL it reports;
    False when there is nothing more to ask (it did not answer, or it has no STATUS)."""
    try:
        node.status = await within(status_or_ping(node.url, options), options.timeout * 2)
    except (TensorwireError, OSError, TimeoutError, ValueError) as exc:
        node.error = str(exc) or type(exc).__name__
        return False
    if node.status is None:
        node.answered = True
        return False
    node.metrics_key = take_key(node.status)
    reported = node.status.get("metrics")
    if reported is not None:
        try:
            node.metrics_url = check_metrics_url(reported)
        except ValueError as exc:
            node.metrics_error = f"not scraped: {exc}"
    return True


def take_key(status: dict[str, Any]) -> str | None:
    """The pseudonym key a STATUS answer carries (``metrics_key``), taken out of it (it is for
    mapping pseudonyms back, not for showing); None when absent or not a short string."""
    key = status.pop("metrics_key", None)
    return key if isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS else None


def named(status: dict[str, Any] | None) -> list[str]:
    """The job ids and generation prefixes a STATUS answer names (what its metrics may label
    series with), at most ``MAX_UNMASKED``."""
    doc = _obj(status)
    ps, gens, relay = _obj(doc.get("ps")), _obj(doc.get("generations")), _obj(doc.get("relay"))
    found: dict[str, None] = {}
    for mapping in (
        ps.get("jobs"),
        gens.get("newest"),
        relay.get("served_bytes"),
        relay.get("readers_by_prefix"),
    ):
        for key in list(_obj(mapping))[:MAX_UNMASKED]:
            found.setdefault(str(key), None)
    return list(found)[:MAX_UNMASKED]


def collect(urls: Sequence[str], timeout: float = DEFAULT_TIMEOUT, **client: Any) -> list[Node]:
    """Every server's ``Node``, asked in parallel; ``client`` are ClientOptions fields (tls, token...)."""
    from tensorwire._aio import run

    options = ClientOptions(timeout=timeout, connect_timeout=timeout, **client)
    return run(probe_all(urls, options))


async def probe_all(urls: Sequence[str], options: ClientOptions) -> list[Node]:
    """Every server's ``Node``, asked at once on the running loop (the dashboard's collection)."""
    return _merge(list(await asyncio.gather(*(probe(url, options) for url in split_urls(urls)))))


def _merge(nodes: list[Node]) -> list[Node]:
    """A scraped metrics page that belongs to a server also listed (by the addresses its
    ``tensorwire_server_info`` names, e.g. a gRPC-only server's) goes into that server's row."""
    by_url = {n.url: n for n in nodes}
    kept = []
    for node in nodes:
        owner = None
        if node.status is None and node.samples and node.url.startswith(("http://", "https://")):
            addresses = (_label(node, "tensorwire_server_info", "addresses") or "").split(",")
            owner = next((by_url[a] for a in addresses if a in by_url and not by_url[a].samples), None)
        if owner is None:
            kept.append(node)
        else:
            owner.samples, owner.metrics_url = node.samples, node.url
    return kept


# -- what the screen shows -------------------------------------------------------------------------
def _lease(ps: dict[str, Any], node: Node) -> str:
    """With a coordinator (``ps serve --coordinator``): the slot, and whether it is down (no
    primary, and this replica may not take over) or its primary serves under the failsafe."""
    led = _obj(ps.get("coordinator"))
    slot = _str(led.get("slot"))
    down = bool(_str(led.get("down"))) or node.value("tensorwire_ps_slot_down") == 1
    failsafe = led.get("failsafe") is True or node.value("tensorwire_ps_failsafe") == 1
    if not slot and not down:
        return ""
    said = f" slot {slot}" if slot else " slot"
    return said + (", DOWN: no up-to-date replica" if down else ", failsafe" if failsafe else "")


def summary(node: Node) -> dict[str, Any]:
    """The columns of the node's row, from STATUS where it answered, else from its metrics. Every
    field is taken only if it has the type it should (a server may answer anything)."""
    status = _obj(node.status)
    store, ps = _obj(status.get("store")), _obj(status.get("ps"))
    role = _str(ps.get("role")) or _label(node, "tensorwire_ps_role", "role")
    jobs = _jobs(ps)
    if (
        role == "primary"
        and not ps.get("mode")
        and not jobs
        and not ps.get("backups")
        and not ps.get("coordinator")
        and not node.value("tensorwire_ps_shards")
    ):
        role = None  # a plain store: a parameter server with no job and no replicas
    epoch = _num(ps.get("epoch"), _int(node.value("tensorwire_ps_epoch")))
    return {
        "host": _where(status),
        "role": f"{role} @{epoch}{_lease(ps, node)}" if role else "",
        "shards": _num(ps.get("shards"), _int(node.value("tensorwire_ps_shards"))),
        "step": _num(ps.get("step"), _int(node.value("tensorwire_ps_steps_total"))),
        "workers": _workers(ps, node),
        "stored": _num(store.get("bytes"), _int(node.value("tensorwire_store_bytes"))),
        "capacity": _num(store.get("capacity"), _int(node.value("tensorwire_store_capacity_bytes"))),
        "connections": _num(status.get("connections"), _int(node.value("tensorwire_connections"))),
        "in_flight": _num(status.get("in_flight"), _int(node.value("tensorwire_requests_in_flight"))),
        "requests": _num(status.get("requests"), _int(node.value("tensorwire_requests_total"))),
        "cpu_s": _finite(node.value("process_cpu_seconds_total")),
        "rss": _int(node.value("process_resident_memory_bytes")),
        "lag": _lag(ps, node),
        "jobs": jobs,
    }


MAX_JOBS_SHOWN = 64  # of one server: a server may answer anything


def _where(status: dict[str, Any]) -> str:
    """``host`` or ``host/rack`` of a STATUS answer ("" from a server that does not say)."""
    host, rack = _str(status.get("host")), _str(status.get("rack"))
    return "" if not host else f"{host}/{rack}" if rack else host


def _jobs(ps: dict[str, Any]) -> list[dict[str, Any]]:
    """The jobs a parameter server lists (id, mode, world, live workers, step), each field checked."""
    jobs = ps.get("jobs")
    if not isinstance(jobs, dict):
        return []
    listed = []
    for job, entry in list(jobs.items())[:MAX_JOBS_SHOWN]:
        e = _obj(entry)
        listed.append({"job": str(job), "mode": _str(e.get("mode")), "world": _num(e.get("world")),
                       "live": _num(e.get("live")), "step": _num(e.get("step"))})  # fmt: skip
    return listed


def _obj(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _num(value: object, default: int | None = None) -> int | None:
    """An integer field of a STATUS answer (anything else: ``default``)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 64
    return value if ok else default  # type: ignore[return-value]


def _finite(value: object) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None  # type: ignore[arg-type]


def _label(node: Node, name: str, label: str) -> str | None:
    for labels, value in node.samples.get(name, []):
        if value:
            return labels.get(label)
    return None


def _int(value: float | None) -> int | None:
    finite = _finite(value)
    return None if finite is None else int(finite)


def _workers(ps: dict[str, Any], node: Node) -> str | None:
    live_list = ps.get("live")
    live = len(live_list) if isinstance(live_list, list) else _int(node.value("tensorwire_ps_live_workers"))
    world = _num(ps.get("world"), _int(node.value("tensorwire_ps_world")))
    return None if live is None else f"{live}/{world}"


def _lag(ps: dict[str, Any], node: Node) -> str | None:
    """A primary: its backups (each up with seconds since its last change, lost and how many
    changes behind, or refusing the primary's peer credentials: changes are refused). A backup:
    seconds since its primary was last heard."""
    backups = ps.get("backups")
    if isinstance(backups, dict):
        parts = []
        for url, entry in backups.items():
            b = _obj(entry)
            host = str(url).split("://", 1)[-1]
            lag_s = _finite(b.get("lag_s"))
            lag = f"{lag_s:.1f}s" if lag_s is not None else "-"
            if b.get("refused"):  # the reason is in --json; the row stays one line
                parts.append(f"{host} REFUSED peer credentials (changes refused)")
            elif b.get("up"):
                parts.append(f"{host} {lag}" + (" SAME HOST" if b.get("same_host") else ""))
            else:
                parts.append(f"{host} LOST, {_num(b.get('behind'))} behind")
        return "; ".join(parts)
    silence = _finite(ps.get("primary_silence_s"))
    if silence is None:
        silence = _finite(node.value("tensorwire_ps_primary_silence_seconds"))
    return None if silence is None else f"primary {silence:.1f}s ago"


__all__ = [
    "DEADLINE_FACTOR", "DEFAULT_TIMEOUT", "MAX_METRICS_BYTES", "Node", "Samples", "answers", "ask_status",
    "check_metrics_url", "collect", "probe", "probe_all", "scrape", "split_urls", "status_or_ping", "summary",
    "take_key",
]  # fmt: skip
