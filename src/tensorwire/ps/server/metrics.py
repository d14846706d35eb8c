"""The parameter server's Prometheus families (added to its server's registry, ``tensorwire.server.metrics``).

Read from the ``ParamServer``'s own state when scraped, so the serving path pays nothing for them
(through ``ParamServerState``, the attributes read, and ``JobSample``, each job's numbers, so this
module does not import the server). Each job's families carry a ``job`` label (its id). Job ids are
chosen by peers (the workers): the label takes only ids the server accepted (wire/ps.py
``check_job_id``: 1 to 64 letters, digits, ``.``, ``_``, ``-``) and at most ``--max-jobs`` jobs are
held at once (a new id beyond them is refused, counted in ``tensorwire_ps_jobs_limit_refused_total``),
so a peer cannot grow the number of series without bound; an ended job's series go with it. On a
server that asks for a token or a client certificate, a scrape without its metrics token
(``--metrics-token-file``; never the clients' token) sees each job id only as its pseudonym
(``server.metrics``: the ``job`` label is not one of ``SERVER_LABELS``); the ``backup`` label is
the server's own configuration and shown as it is.

Per job (label ``job``):

* ``tensorwire_ps_steps_total`` (sync steps taken), ``tensorwire_ps_updates_total`` (optimizer
  updates, any mode), ``tensorwire_ps_pushes_applied_total``, ``tensorwire_ps_duplicate_pushes_total``
  (resent pushes answered without being applied again: the workers' retries).
* ``tensorwire_ps_staleness``: histogram of the staleness of applied pushes (in clocks).
* ``tensorwire_ps_live_workers``, ``tensorwire_ps_world``, ``tensorwire_ps_workers_dropped_total``,
  ``tensorwire_ps_barrier`` (the last barrier generation released).
* ``tensorwire_ps_shards``, ``tensorwire_ps_shard_bytes``: what this server holds of the job.
* ``tensorwire_ps_identity_refused_total`` (requests under a rank another session holds),
  ``tensorwire_ps_jobs_refused_total`` (joins under the job's id of another job: model, mode,
  optimizer, world), ``tensorwire_ps_checkpoints_skipped_total`` (newer checkpoints passed over at
  a restore: not complete), ``tensorwire_ps_job_held_bytes{job,kind}``.

The server's (no ``job`` label):

* ``tensorwire_ps_jobs`` (jobs held), ``tensorwire_ps_max_jobs``, ``tensorwire_ps_jobs_limit_refused_total``.
* ``tensorwire_ps_role{role}`` (1 for this replica's role: primary, backup or fenced),
  ``tensorwire_ps_epoch``, ``tensorwire_ps_failovers_total`` (times this replica took over).
* ``tensorwire_ps_held_bytes{kind}`` (params, optimizer, gradients, payloads, snapshots: what all
  jobs hold) against ``tensorwire_ps_capacity_bytes``, ``tensorwire_ps_capacity_refused_total``.
* Replication lag, on a primary for each ``backup``: ``tensorwire_ps_backup_up`` (0 once lost or
  refusing), ``tensorwire_ps_replication_lag_seconds`` (since it last applied a change; pings go
  every 0.5 s) and ``tensorwire_ps_replication_behind_changes`` (changes it missed while lost);
  on a backup, ``tensorwire_ps_primary_silence_seconds`` (since its primary's last change or ping).
* A backup on this primary's host: ``tensorwire_ps_backup_same_host{backup}`` (1: a host failure
  loses both; known once connected, from the backup's HELLO).
* Replication refused: ``tensorwire_ps_backup_refused{backup}`` (1 while a backup refuses this
  primary's peer credentials: a configuration error, changes are refused meanwhile),
  ``tensorwire_ps_replication_refusals_total`` (changes not made because of it), and
  ``tensorwire_ps_replicate_refused_total{reason}`` (PS_REPLICATE frames this replica refused:
  ``not_peer``, from a connection without the peer token; ``malformed``, e.g. an epoch out of range).
* Leadership by a coordinator's lease (``ps serve --coordinator``; absent without one):
  ``tensorwire_ps_lease_held`` (1 while this replica's term holds), ``tensorwire_ps_slot_down``
  (1 while the slot has no primary and this replica, not up to date, may not take over),
  ``tensorwire_ps_failsafe`` (1 while a primary serves past its term with the coordinator
  unreachable, reaching every backup), ``tensorwire_ps_step_downs_total`` (terms this replica
  lost or gave up), ``tensorwire_ps_coordinator_errors_total`` (coordinator calls that failed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tensorwire.ps.budget import Budget
from tensorwire.ps.server.replication import Backups

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class JobSample:
    """One job's numbers at a scrape (copied: the event loop changes the job meanwhile)."""

    job: str
    step: int
    version: int
    pushes: int
    duplicates: int
    dropped: int
    staleness: dict[int, int]
    live: int
    world: int
    barrier: int
    shards: int
    shard_bytes: int
    identity_refused: int
    jobs_refused: int
    checkpoints_skipped: int
    held: dict[str, int]

    @staticmethod
    def of(run: Any) -> JobSample:
        """From a ps/server/jobs.py ``JobRun`` (read, not imported: the server's parts import this)."""
        job, members, shards = run.job, run.members, list(run.job.shards.values())
        return JobSample(
            run.id, job.step, job.version, job.pushes, run.consistency.duplicates, members.dropped,
            dict(run.consistency.staleness), sum(m.live for m in list(members.workers.values())), job.world,
            members.released, len(shards), sum(s.meta.nbytes for s in shards), members.identity_refused,
            job.jobs_refused, run.state.skipped, dict(run.budget.held),
        )  # fmt: skip


class ParamServerState(Protocol):
    """What the families are read from: a ``ParamServer`` (ps/server/param_server.py) has all of it."""

    @property
    def failovers(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def role(self) -> str: ...
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
    @property
    def jobs(self) -> Any: ...  # ps/server/jobs.py ``Jobs``: len(), max_jobs, refused
    def job_samples(self) -> list[JobSample]: ...
    def leadership_status(self) -> dict[str, Any] | None: ...


class PsCollector:
    """A parameter server's state as Prometheus families (the module doc lists them)."""

    def __init__(self, ps: ParamServerState) -> None:
        self._ps = ps

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ps = self._ps
        yield from _jobs(ps.job_samples())
        for name, doc, value in (
            ("failovers", "Times this replica took over from its primary.", ps.failovers),
            ("jobs_limit_refused", "New jobs refused: the server held --max-jobs.", ps.jobs.refused),
            ("capacity_refused", "Pushes, pulls and jobs refused: the capacity was full.", ps.budget.refused),
        ):
            yield CounterMetricFamily(f"tensorwire_ps_{name}", doc, value=value)
        for name, doc, value in (
            ("epoch", "The replica set's epoch this replica is at.", ps.epoch),
            ("jobs", "Jobs held.", len(ps.jobs)),
            ("max_jobs", "The most jobs held at once (--max-jobs).", ps.jobs.max_jobs),
            ("capacity_bytes", "The server's capacity.", ps.capacity),
        ):
            yield GaugeMetricFamily(f"tensorwire_ps_{name}", doc, value=value)
        role = GaugeMetricFamily("tensorwire_ps_role", "This replica's role (1).", labels=["role"])
        role.add_metric([ps.role], 1)
        yield role
        held = GaugeMetricFamily("tensorwire_ps_held_bytes", "Bytes all jobs hold, by kind.", labels=["kind"])
        for kind, nbytes in dict(ps.budget.held).items():
            held.add_metric([kind], nbytes)
        yield held
        yield from _replication(ps)
        yield from _leadership(ps.leadership_status())


def _leadership(status: dict[str, Any] | None) -> Iterator[Any]:
    """The lease's families (the module doc), with a coordinator only."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if status is None:
        return
    for name, doc, value in (
        ("lease_held", "1 while this replica's term as its slot's primary holds.", status["holds_term"]),
        ("slot_down", "1 while the slot has no primary and this replica may not take over.",
         bool(status["down"])),
        ("failsafe", "1 while serving past the term: coordinator unreachable, every backup reached.",
         status["failsafe"]),
    ):  # fmt: skip
        yield GaugeMetricFamily(f"tensorwire_ps_{name}", doc, value=int(value))
    for name, doc, value in (
        ("step_downs", "Terms this replica lost or gave up as its slot's primary.", status["step_downs"]),
        ("coordinator_errors", "Calls to the coordinator that failed.", status["coordinator_errors"]),
    ):
        yield CounterMetricFamily(f"tensorwire_ps_{name}", doc, value=value)


_JOB_COUNTERS = (
    ("steps", "Synchronous steps taken.", "step"),
    ("updates", "Optimizer updates applied (any mode).", "version"),
    ("pushes_applied", "Pushed gradients applied.", "pushes"),
    ("duplicate_pushes", "Resent pushes answered without applying them again.", "duplicates"),
    ("workers_dropped", "Workers dropped for missed heartbeats.", "dropped"),
    ("identity_refused", "Requests under a rank that another session joined with.", "identity_refused"),
    ("jobs_refused", "Joins and inits under the job's id of another job (model, mode, optimizer, world).",
     "jobs_refused"),
    ("checkpoints_skipped", "Checkpoints skipped at a restore: not complete.", "checkpoints_skipped"),
)  # fmt: skip
_JOB_GAUGES = (
    ("live_workers", "Workers live in the job.", "live"),
    ("world", "The job's number of workers.", "world"),
    ("barrier", "The last barrier generation released.", "barrier"),
    ("shards", "Shards of the job held here.", "shards"),
    ("shard_bytes", "Bytes of the job's shards held here.", "shard_bytes"),
)


def _jobs(samples: Sequence[JobSample]) -> Iterator[Any]:
    """Each job's families, labelled by its id (accepted by the server: bounded, see the doc)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, doc, attr in _JOB_COUNTERS:
        counter = CounterMetricFamily(f"tensorwire_ps_{name}", doc, labels=["job"])
        for sample in samples:
            counter.add_metric([sample.job], getattr(sample, attr))
        yield counter
    for name, doc, attr in _JOB_GAUGES:
        gauge = GaugeMetricFamily(f"tensorwire_ps_{name}", doc, labels=["job"])
        for sample in samples:
            gauge.add_metric([sample.job], getattr(sample, attr))
        yield gauge
    held = GaugeMetricFamily(
        "tensorwire_ps_job_held_bytes", "Bytes a job holds, by kind.", labels=["job", "kind"]
    )
    for sample in samples:
        for kind, nbytes in sample.held.items():
            held.add_metric([sample.job, kind], nbytes)
    yield held
    yield _staleness(samples)


def _staleness(samples: Sequence[JobSample]) -> Any:
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(
        "tensorwire_ps_staleness", "Staleness of applied pushes, in clocks.", labels=["job"]
    )
    for sample in samples:
        counts = sample.staleness
        buckets = [(str(b), sum(n for s, n in counts.items() if s <= b)) for b in STALENESS_BUCKETS]
        buckets.append(("+Inf", sum(counts.values())))
        family.add_metric([sample.job], buckets, sum(s * n for s, n in counts.items()))
    return family


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
        same_host = GaugeMetricFamily(
            "tensorwire_ps_backup_same_host",
            "A backup runs on this primary's host (a host failure loses both).",
            labels=["backup"],
        )
        for b in list(backups.backups.values()):  # the URLs are this server's configuration
            up.add_metric([b.url], float(not b.lost and not b.refused))
            lag.add_metric([b.url], now - b.acked if b.acked is not None else math.nan)
            behind.add_metric([b.url], b.behind)
            refused.add_metric([b.url], float(b.refused is not None))
            same_host.add_metric([b.url], float(b.same_host is not None))
        yield from (up, lag, behind, refused, same_host)
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
                "same_host": b.same_host,  # the host it shares with this primary, or None
            }
            for b in list(ps.backups.backups.values())
        }
        doc["replication_refusals"] = ps.backups.refusals
    if ps.replicate_refused:
        doc["replicate_refused"] = dict(ps.replicate_refused)
    if ps.role == "backup" and ps.primary_seen is not None:
        doc["primary_silence_s"] = now - ps.primary_seen
    return doc
