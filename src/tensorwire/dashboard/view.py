"""What the dashboard page shows, from the servers' STATUS answers and metrics: a pure view model.

``View.update(nodes, now)`` takes one snapshot (``collect.Node`` per server, as ``probe`` made
them) and returns the page's document (plain JSON types). Rates (bytes/s, requests/s, pushes/s,
latency percentiles) are counter deltas between this snapshot and the previous one; the timeline
holds the events seen between two snapshots:

* ``failover``: a replica became primary, or its epoch rose (the slot's new primary and epoch);
* ``down`` / ``up``: a server stopped answering (with why) or answered again;
* ``dropped`` / ``rejoined``: a job's dropped-workers counter rose, or its live workers grew back;
* ``checksum``: a server's checksum-failure counter rose (corrupt chunks, re-sent, never stored).

Nothing here does I/O or reads a clock: the app passes ``now``; the unit tests pass canned nodes.
Every value a server sent is type-checked (``collect.summary``) and handed to the page as data:
the page sets it as text, never as markup.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorwire.dashboard.collect import Node, split_urls, summary

HISTORY = 120  # points kept per server for the charts: two minutes at one snapshot a second
TIMELINE = 200  # events kept, newest last
PERCENTILES = (50, 90, 99)


def slots_of(urls: Sequence[str]) -> list[list[str]]:
    """The slots named on the command line: ``a|b`` is one slot of two replicas, ``a,b`` two slots."""
    slots = []
    for text in urls:
        for slot in text.split(","):
            replicas = split_urls([slot.replace("|", ",")])
            if replicas:
                slots.append(replicas)
    return slots


@dataclass
class Seen:
    """One server at the previous snapshot: what the next one is compared with."""

    up: bool
    role: str | None
    epoch: int | None
    counters: dict[str, float]
    buckets: dict[float, float]  # latency histogram, cumulative count by upper bound
    jobs: dict[str, dict[str, float]]  # job -> pushes, dropped, live
    t: float


@dataclass
class View:
    """The dashboard's state across snapshots: the last one seen, the charts' history, the timeline."""

    slots: list[list[str]]
    seen: dict[str, Seen] = field(default_factory=dict)
    history: dict[str, deque[dict[str, Any]]] = field(default_factory=dict)
    timeline: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=TIMELINE))

    def update(self, nodes: Sequence[Node], now: float) -> dict[str, Any]:
        """The page's document for this snapshot (and the state kept for the next)."""
        servers = [self._server(node, now) for node in nodes]
        by_url = {s["url"]: s for s in servers}
        return {
            "t": now,
            "up": sum(s["up"] for s in servers),
            "total": len(servers),
            "slots": [
                _slot(i, [by_url[u] for u in urls if u in by_url]) for i, urls in enumerate(self.slots)
            ],
            "servers": servers,
            "jobs": [job for node in nodes for job in _jobs(node, by_url[node.url])],
            "generations": [g for node in nodes for g in _generations(node)],
            "timeline": list(self.timeline),
        }

    def _server(self, node: Node, now: float) -> dict[str, Any]:
        before = self.seen.get(node.url)
        row = _row(node)
        seen = _seen(node, row, now)
        if before is not None and not node.up:  # a server that is down keeps its last known role
            seen.role, seen.epoch = before.role, before.epoch
        rates = _rates(before, seen) if before is not None and node.up and before.up else _no_rates()
        row["rates"] = rates
        row["jobs_rates"] = _job_rates(before, seen) if before is not None else {}
        self._events(node, row, before, seen)
        self.seen[node.url] = seen
        points = self.history.setdefault(node.url, deque(maxlen=HISTORY))
        points.append({"t": now, **{k: rates[k] for k in ("in_bps", "out_bps", "req_s", "p99_ms")}})
        row["history"] = list(points)
        return row

    def _events(self, node: Node, row: dict[str, Any], before: Seen | None, seen: Seen) -> None:
        if before is None:
            if not node.up:
                self._event(seen.t, "down", node.url, f"down: {node.error or 'no answer'}")
            return
        for kind, text in _changes(node, before, seen):
            self._event(seen.t, kind, node.url, text)

    def _event(self, t: float, kind: str, url: str, text: str) -> None:
        self.timeline.append({"t": t, "kind": kind, "server": url, "text": text})


def _obj(value: object) -> dict[str, Any]:
    """A JSON object a server sent, or an empty one in place of anything else."""
    return value if isinstance(value, dict) else {}


def _row(node: Node) -> dict[str, Any]:
    """The server's row: up or down (with why), role, epoch, store, connections, replication lag."""
    s = summary(node) if node.up else {}
    status = _obj(node.status)
    store = _obj(status.get("store"))
    role, epoch = _role(node)
    tensors = (
        store.get("tensors")
        if isinstance(store.get("tensors"), int)
        else node.value("tensorwire_store_tensors")
    )
    return {
        "url": node.url,
        "up": node.up,
        "error": None if node.up else (node.error or "no answer"),
        "metrics_error": node.metrics_error,
        "host": s.get("host", ""),
        "role": role,
        "epoch": epoch,
        "stored": s.get("stored"),
        "capacity": s.get("capacity"),
        "tensors": None if tensors is None else int(tensors),
        "connections": s.get("connections"),
        "in_flight": s.get("in_flight"),
        "requests": s.get("requests"),
        "lag": s.get("lag"),
        **_ps_held(node),
    }


def _ps_held(node: Node) -> dict[str, int | None]:
    """What a parameter server's jobs hold (parameters, optimizer state...) against its capacity:
    apart from the store's bytes (STATUS, else metrics)."""
    ps = _obj(_obj(node.status).get("ps"))
    kinds = _obj(ps.get("held_bytes"))
    held: float | None = (
        sum(_count(v) for v in kinds.values()) if kinds else node.value("tensorwire_ps_held_bytes")
    )
    capacity = (
        ps.get("capacity") if _count(ps.get("capacity")) else node.value("tensorwire_ps_capacity_bytes")
    )
    return {"ps_held": _whole(held), "ps_capacity": _whole(capacity)}


def _whole(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


def _role(node: Node) -> tuple[str | None, int | None]:
    """The replica's role and epoch ("primary", 3); (None, None) for a server that is down."""
    if not node.up:
        return None, None
    status = _obj(node.status)
    ps = _obj(status.get("ps"))
    role = ps.get("role") if isinstance(ps.get("role"), str) else None
    if role is None:
        role = next(
            (labels.get("role") for labels, v in node.samples.get("tensorwire_ps_role", []) if v), None
        )
    epoch = ps.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        value = node.value("tensorwire_ps_epoch")
        epoch = int(value) if value is not None and math.isfinite(value) else None
    return role, epoch


COUNTERS = {
    "requests": "tensorwire_requests_total",
    "checksum": "tensorwire_checksum_failures_total",
    "errors": "tensorwire_request_errors_total",
}


def _seen(node: Node, row: dict[str, Any], now: float) -> Seen:
    counters = {key: node.value(name) or 0.0 for key, name in COUNTERS.items()}
    if not node.samples and isinstance(row.get("requests"), int):
        counters["requests"] = float(row["requests"])  # no metrics: STATUS counts requests too
    for name, key in (("tensorwire_received_bytes_total", "in"), ("tensorwire_sent_bytes_total", "out")):
        for labels, value in node.samples.get(name, []):
            transport = labels.get("transport", "?")
            counters[f"{key}:{transport}"] = counters.get(f"{key}:{transport}", 0.0) + value
    buckets: dict[float, float] = {}
    for labels, value in node.samples.get("tensorwire_request_duration_seconds_bucket", []):
        bound = _bound(labels.get("le"))
        if bound is not None:
            buckets[bound] = buckets.get(bound, 0.0) + value
    return Seen(node.up, row["role"], row["epoch"], counters, buckets, _job_counts(node), now)


def _bound(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _job_counts(node: Node) -> dict[str, dict[str, float]]:
    """Each job's pushes applied, workers dropped and live workers (metrics, else STATUS)."""
    jobs: dict[str, dict[str, float]] = {}
    names = {"pushes": "tensorwire_ps_pushes_applied_total", "dropped": "tensorwire_ps_workers_dropped_total",
             "live": "tensorwire_ps_live_workers"}  # fmt: skip
    for key, name in names.items():
        for labels, value in node.samples.get(name, []):
            jobs.setdefault(labels.get("job", "?"), {})[key] = value
    for job, entry in _status_jobs(node).items():
        counts = jobs.setdefault(job, {})
        for key, field_name in (("pushes", "pushes_applied"), ("live", "live")):
            number = entry.get(field_name)
            if key not in counts and isinstance(number, int) and not isinstance(number, bool):
                counts[key] = float(number)
    return jobs


def _status_jobs(node: Node) -> dict[str, dict[str, Any]]:
    status = _obj(node.status)
    ps = _obj(status.get("ps"))
    jobs = ps.get("jobs")
    if not isinstance(jobs, dict):
        return {}
    return {str(k): v for k, v in list(jobs.items())[:64] if isinstance(v, dict)}


def _no_rates() -> dict[str, Any]:
    return {"in_bps": None, "out_bps": None, "req_s": None, "by_transport": {},
            **{f"p{p}_ms": None for p in PERCENTILES}}  # fmt: skip


def _rates(before: Seen, now: Seen) -> dict[str, Any]:
    """Per-second rates between two snapshots of one server; a counter that went down (the
    server restarted) counts from zero."""
    dt = now.t - before.t
    if dt <= 0:
        return _no_rates()

    def rate(key: str) -> float:
        new, old = now.counters.get(key, 0.0), before.counters.get(key, 0.0)
        return (new - old if new >= old else new) / dt

    transports = sorted({k.split(":", 1)[1] for k in now.counters if ":" in k})
    by_transport = {t: {"in_bps": rate(f"in:{t}"), "out_bps": rate(f"out:{t}")} for t in transports}
    rates: dict[str, Any] = {
        "in_bps": sum(v["in_bps"] for v in by_transport.values()),
        "out_bps": sum(v["out_bps"] for v in by_transport.values()),
        "req_s": rate("requests"),
        "by_transport": by_transport,
    }
    for p in PERCENTILES:
        q = percentile(before.buckets, now.buckets, p / 100)
        rates[f"p{p}_ms"] = None if q is None else q * 1000
    return rates


def percentile(before: dict[float, float], now: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of the requests timed between two cumulative histograms (by upper
    bound), interpolated linearly within its bucket as Prometheus's ``histogram_quantile`` does;
    None when no request was timed in between."""
    bounds = sorted(now)
    counts = [now[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0 or any(c < 0 for c in counts):
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower  # above the highest finite bound: say the bound, as Prometheus does
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _job_rates(before: Seen, now: Seen) -> dict[str, float]:
    dt = now.t - before.t
    rates = {}
    for job, counts in now.jobs.items():
        old = before.jobs.get(job, {}).get("pushes")
        new = counts.get("pushes")
        if old is not None and new is not None and dt > 0:
            rates[job] = (new - old if new >= old else new) / dt
    return rates


def _changes(node: Node, before: Seen, now: Seen) -> list[tuple[str, str]]:
    """The events between two snapshots of one server."""
    if before.up and not now.up:
        return [("down", f"down: {node.error or 'no answer'}")]
    if not now.up:
        return []
    events = [] if before.up else [("up", "answers again")]
    # A replica that became primary, or a primary at a newer epoch (it took over between two
    # snapshots); a backup following its primary's epoch is no failover.
    became = now.role == "primary" and before.role not in (None, "primary")
    newer = now.role == "primary" and (now.epoch or 0) > (before.epoch or 0) and before.epoch is not None
    if became or newer:
        events.append(
            ("failover", f"failover: {now.role} at epoch {now.epoch} (was {before.role} @{before.epoch})")
        )
    corrupt = now.counters.get("checksum", 0.0) - before.counters.get("checksum", 0.0)
    if corrupt > 0:
        events.append(("checksum", f"{corrupt:.0f} chunk(s) failed their checksum (re-sent, not stored)"))
    for job, counts in now.jobs.items():
        old = before.jobs.get(job, {})
        dropped = counts.get("dropped", 0.0) - old.get("dropped", counts.get("dropped", 0.0))
        if dropped > 0:
            events.append(("dropped", f"job {job}: {dropped:.0f} worker(s) dropped (missed heartbeats)"))
        live, was = counts.get("live"), old.get("live")
        if live is not None and was is not None and live > was and before.jobs.get(job, {}).get("dropped"):
            events.append(("rejoined", f"job {job}: {live - was:.0f} worker(s) rejoined"))
    return events


def _slot(index: int, replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """One slot: its replicas, which one is primary, its epoch, whether it can serve."""
    primary = next((r for r in replicas if r["up"] and r["role"] in ("primary", None)), None)
    epochs = [r["epoch"] for r in replicas if r["epoch"] is not None]
    return {
        "slot": index,
        "primary": primary["url"] if primary else None,
        "epoch": max(epochs) if epochs else None,
        "up": primary is not None,
        "replicas": [{k: r[k] for k in ("url", "up", "role", "epoch", "lag", "error")} for r in replicas],
    }


def _jobs(node: Node, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The jobs of a server that is up and primary (a backup's copy of a job is not another job)."""
    if not node.up or row["role"] not in ("primary", None):
        return []
    rates = row.get("jobs_rates", {})
    jobs = []
    for entry in summary(node)["jobs"]:
        job = entry["job"]
        raw = _status_jobs(node).get(job, {})
        jobs.append({
            "server": node.url, "job": job, "mode": entry["mode"], "step": entry["step"],
            "live": entry["live"], "world": entry["world"], "pushes_s": rates.get(job),
            "optimizer": _optimizer(raw.get("optimizer")), "staleness": _staleness(node, job),
        })  # fmt: skip
    return jobs


def _optimizer(spec: object) -> str | None:
    """``adam lr=0.001``: the optimizer's kind and learning rate, from its spec (a dict)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        return None
    lr, kind = spec.get("lr"), str(spec["kind"])
    return kind + (f" lr={lr:g}" if isinstance(lr, (int, float)) and not isinstance(lr, bool) else "")


def _staleness(node: Node, job: str) -> list[list[Any]]:
    """The job's staleness histogram as [[bucket label, pushes in it], ...] (not cumulative)."""
    cumulative = []
    for labels, value in node.samples.get("tensorwire_ps_staleness_bucket", []):
        bound = _bound(labels.get("le"))
        if labels.get("job") == job and bound is not None:
            cumulative.append((bound, value))
    cumulative.sort()
    bars, below = [], 0.0
    for bound, value in cumulative:
        bars.append(["inf" if math.isinf(bound) else f"{bound:g}", max(value - below, 0.0)])
        below = value
    return bars


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _generations(node: Node) -> list[dict[str, Any]]:
    """The newest generation of each prefix the server holds, and how many read it via the relay."""
    status = _obj(node.status)
    gens = _obj(status.get("generations"))
    newest = _obj(gens.get("newest"))
    relay = _obj(status.get("relay"))
    readers = _obj(relay.get("readers_by_prefix"))
    return [
        {
            "server": node.url,
            "prefix": str(prefix),
            "newest": number,
            "readers": _count(readers.get(prefix)),
        }
        for prefix, number in list(newest.items())[:64]
        if isinstance(number, int) and not isinstance(number, bool)
    ]


__all__ = ["HISTORY", "PERCENTILES", "TIMELINE", "View", "percentile", "slots_of"]
