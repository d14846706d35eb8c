"""The parameter server's Prometheus families (added to its server's registry, ``tensorwire.server.metrics``).

Read from the ``ParamServer``'s own state when scraped, so the serving path pays nothing for them
(through ``ParamServerState``, the attributes read, so this module does not import the server):

* ``tensorwire_ps_steps_total`` (sync steps taken), ``tensorwire_ps_updates_total`` (optimizer
  updates, any mode), ``tensorwire_ps_pushes_applied_total``, ``tensorwire_ps_duplicate_pushes_total``
  (resent pushes answered without being applied again: the workers' retries).
* ``tensorwire_ps_staleness``: histogram of the staleness of applied pushes (in clocks).
* ``tensorwire_ps_live_workers``, ``tensorwire_ps_world``, ``tensorwire_ps_workers_dropped_total``.
* ``tensorwire_ps_shards``, ``tensorwire_ps_shard_bytes``: what this server holds of the job.
* ``tensorwire_ps_role{role}`` (1 for this replica's role: primary, backup or fenced),
  ``tensorwire_ps_epoch``, ``tensorwire_ps_failovers_total`` (times this replica took over).
* ``tensorwire_ps_identity_refused_total`` (requests under a rank another session holds),
  ``tensorwire_ps_jobs_refused_total`` (joins of another job), ``tensorwire_ps_checkpoints_skipped_total``
  (newer checkpoints passed over at a restore: not complete), ``tensorwire_ps_held_bytes{kind}``
  (params, gradients, payloads, snapshots: what the job holds) against ``tensorwire_ps_capacity_bytes``,
  ``tensorwire_ps_capacity_refused_total``.
* Replication lag, on a primary for each ``backup``: ``tensorwire_ps_backup_up`` (0 once lost or
  refusing), ``tensorwire_ps_replication_lag_seconds`` (since it last applied a change; pings go
  every 0.5 s) and ``tensorwire_ps_replication_behind_changes`` (changes it missed while lost);
  on a backup, ``tensorwire_ps_primary_silence_seconds`` (since its primary's last change or ping).
* Replication refused: ``tensorwire_ps_backup_refused{backup}`` (1 while a backup refuses this
  primary's peer credentials: a configuration error, changes are refused meanwhile),
  ``tensorwire_ps_replication_refusals_total`` (changes not made because of it), and
  ``tensorwire_ps_replicate_refused_total{reason}`` (PS_REPLICATE frames this replica refused:
  ``not_peer``, from a connection without the peer token; ``malformed``, e.g. an epoch out of range).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from tensorwire.ps.budget import Budget
from tensorwire.ps.job import HeldShard
from tensorwire.ps.membership import Member
from tensorwire.ps.replication import Backups

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class ParamServerState(Protocol):
    """What the families are read from: a ``ParamServer`` (ps/server.py) has all of it."""

    @property
    def step(self) -> int: ...
    @property
    def version(self) -> int: ...
    @property
    def pushes(self) -> int: ...
    @property
    def duplicates(self) -> int: ...
    @property
    def dropped(self) -> int: ...
    @property
    def failovers(self) -> int: ...
    @property
    def staleness(self) -> Mapping[int, int]: ...
    @property
    def workers(self) -> Mapping[int, Member]: ...
    @property
    def world(self) -> int: ...
    @property
    def shards(self) -> Mapping[str, HeldShard]: ...
    @property
    def epoch(self) -> int: ...
    @property
    def role(self) -> str: ...
    @property
    def identity_refused(self) -> int: ...
    @property
    def jobs_refused(self) -> int: ...
    @property
    def checkpoints_skipped(self) -> int: ...
    @property
    def budget(self) -> Budget: ...
    @property
    def capacity(self) -> int: ...
    @property
    def replicate_refused(self) -> Mapping[str, int]: ...
    @property
    def backups(self) -> Backups | None: ...
    @property
    def primary_seen(self) -> float | None: ...


class PsCollector:
    """A parameter server's state as Prometheus families (the module doc lists them)."""

    def __init__(self, ps: ParamServerState) -> None:
        self._ps = ps

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ps = self._ps
        workers = list(ps.workers.values())  # copies: the loop thread changes them meanwhile
        shards = list(ps.shards.values())
        for name, doc, value in (
            ("steps", "Synchronous steps taken.", ps.step),
            ("updates", "Optimizer updates applied (any mode).", ps.version),
            ("pushes_applied", "Pushed gradients applied.", ps.pushes),
            ("duplicate_pushes", "Resent pushes answered without applying them again.", ps.duplicates),
            ("workers_dropped", "Workers dropped for missed heartbeats.", ps.dropped),
            ("failovers", "Times this replica took over from its primary.", ps.failovers),
        ):
            yield CounterMetricFamily(f"tensorwire_ps_{name}", doc, value=value)
        yield _staleness(dict(ps.staleness))
        for name, doc, value in (
            ("live_workers", "Workers live in the job.", sum(w.live for w in workers)),
            ("world", "The job's number of workers.", ps.world),
            ("shards", "Shards held here.", len(shards)),
            ("shard_bytes", "Bytes of the shards held here.", sum(s.meta.nbytes for s in shards)),
            ("epoch", "The replica set's epoch this replica is at.", ps.epoch),
        ):
            yield GaugeMetricFamily(f"tensorwire_ps_{name}", doc, value=value)
        role = GaugeMetricFamily("tensorwire_ps_role", "This replica's role (1).", labels=["role"])
        role.add_metric([ps.role], 1)
        yield role
        yield from _guards(ps)
        yield from _replication(ps)


def _guards(ps: ParamServerState) -> Iterator[Any]:
    """What the server refused or fell back on, and what its job holds against its capacity."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, doc, value in (
        ("identity_refused", "Requests under a rank that another session joined with.", ps.identity_refused),
        ("jobs_refused", "Joins and inits of another job (model, mode, optimizer, world).", ps.jobs_refused),
        ("checkpoints_skipped", "Checkpoints skipped at a restore: not complete.", ps.checkpoints_skipped),
        ("capacity_refused", "Pushes, pulls and jobs refused: the capacity was full.", ps.budget.refused),
    ):
        yield CounterMetricFamily(f"tensorwire_ps_{name}", doc, value=value)
    held = GaugeMetricFamily("tensorwire_ps_held_bytes", "Bytes the job holds, by kind.", labels=["kind"])
    for kind, nbytes in dict(ps.budget.held).items():
        held.add_metric([kind], nbytes)
    yield held
    yield GaugeMetricFamily("tensorwire_ps_capacity_bytes", "The server's capacity.", value=ps.capacity)


def _staleness(counts: dict[int, int]) -> Any:
    from prometheus_client.core import HistogramMetricFamily

    buckets = [(str(bound), sum(n for s, n in counts.items() if s <= bound)) for bound in STALENESS_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    total = sum(s * n for s, n in counts.items())
    return HistogramMetricFamily(
        "tensorwire_ps_staleness", "Staleness of applied pushes, in clocks.", buckets=buckets, sum_value=total
    )


def _replication(ps: ParamServerState) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    now = time.monotonic()
    refused_frames = CounterMetricFamily(
        "tensorwire_ps_replicate_refused", "PS_REPLICATE frames refused, by reason.", labels=["reason"]
    )
    for reason in ("not_peer", "malformed"):  # a fixed set: labels never take a peer's values
        refused_frames.add_metric([reason], ps.replicate_refused.get(reason, 0))
    yield refused_frames
    backups = ps.backups
    if backups is not None:
        up = GaugeMetricFamily("tensorwire_ps_backup_up", "A backup is applying changes.", labels=["backup"])
        lag = GaugeMetricFamily(
            "tensorwire_ps_replication_lag_seconds",
            "Since a backup last applied a change.",
            labels=["backup"],
        )
        behind = GaugeMetricFamily(
            "tensorwire_ps_replication_behind_changes", "Changes a lost backup missed.", labels=["backup"]
        )
        refused = GaugeMetricFamily(
            "tensorwire_ps_backup_refused",
            "A backup refuses this primary's peer credentials (changes are refused).",
            labels=["backup"],
        )
        for b in list(backups.backups.values()):  # the URLs are this server's configuration
            up.add_metric([b.url], float(not b.lost and not b.refused))
            lag.add_metric([b.url], now - b.acked if b.acked is not None else math.nan)
            behind.add_metric([b.url], b.behind)
            refused.add_metric([b.url], float(b.refused is not None))
        yield from (up, lag, behind, refused)
        yield CounterMetricFamily(
            "tensorwire_ps_replication_refusals",
            "Changes not made because a backup refused this primary's peer credentials.",
            value=backups.refusals,
        )
    seen = ps.primary_seen
    if ps.role == "backup":
        silence = now - seen if seen is not None else math.nan
        yield GaugeMetricFamily(
            "tensorwire_ps_primary_silence_seconds", "Since the primary's last change or ping.", value=silence
        )


def replication_status(ps: ParamServerState) -> dict[str, Any]:
    """The replication part of the STATUS answer: each backup's state, or the primary's silence."""
    now = time.monotonic()
    doc: dict[str, Any] = {}
    if ps.backups is not None:
        doc["backups"] = {
            b.url: {
                "up": not b.lost and not b.refused,
                "lag_s": now - b.acked if b.acked is not None else None,
                "behind": b.behind,
                "refused": b.refused,  # why it refuses this primary's peer credentials, or None
            }
            for b in list(ps.backups.backups.values())
        }
        doc["replication_refusals"] = ps.backups.refusals
    if ps.replicate_refused:
        doc["replicate_refused"] = dict(ps.replicate_refused)
    if ps.role == "backup" and ps.primary_seen is not None:
        doc["primary_silence_s"] = now - ps.primary_seen
    return doc
