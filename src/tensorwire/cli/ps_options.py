"""The parameter server's options, on ``tensorwire ps serve`` only (``ps_options``): one ``PsOptions``,
which ``param_server`` turns into the ``ParamServer`` extension. ``tensorwire serve`` runs the
same extension with the defaults (``PsOptions()``), so a worker can use any tensorwire server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tensorwire.cli.options import FILE, url_param
from tensorwire.cli.server_options import flags_of, option_group
from tensorwire.security import Security, TlsFiles, load_token

if TYPE_CHECKING:  # the parameter server's modules load when a server starts
    from tensorwire.ps import Coordination, ParamServer


@dataclass(frozen=True)
class PsOptions:
    """The ``ParamServer`` of ``ps serve`` (each field its flag, with the flag's default)."""

    workers: int = 1  # the world size of a gRPC GradientService caller that sends none
    wait_timeout: float = 120.0
    heartbeat_timeout: float = 10.0
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    checkpoint_seconds: float = 0.0
    keep_jobs: bool = False
    max_jobs: int = 8
    backups: tuple[str, ...] = ()
    standby: bool = False
    failover_timeout: float = 2.0
    peer: Security = field(default_factory=Security)  # how the replicas of a slot reach and admit each other
    operator_token: str | None = None
    threads: int | None = None  # torch threads for the optimizer; None: half the cores, at most 4
    coordinator: Coordination | None = None  # --coordinator and its flags: the lease decides the primary

    @property
    def torch_threads(self) -> int:
        # The optimizer's element-wise steps are memory-bound: a few threads get most of the speed,
        # and more (spinning OpenMP threads) take cores from the workers that often share the host.
        return self.threads or max(1, min(4, (os.cpu_count() or 2) // 2))


def param_server(ps: PsOptions, capacity: int) -> ParamServer:
    """The extension ``ps`` describes, sharing the store's ``capacity`` (one ledger), with the jobs
    its checkpoint directory holds restored (each one said on stdout)."""
    from tensorwire.ps import CheckpointPolicy, ParamServer

    policy = (
        CheckpointPolicy(ps.checkpoint_dir, ps.checkpoint_every, ps.checkpoint_seconds)
        if ps.checkpoint_dir
        else None
    )
    server = ParamServer(
        ps.wait_timeout,
        ps.workers,
        capacity,
        heartbeat_timeout=ps.heartbeat_timeout,
        checkpoints=policy,
        backups=ps.backups,
        standby=ps.standby,
        failover_timeout=ps.failover_timeout,
        peer=ps.peer,
        max_jobs=ps.max_jobs,
        keep_jobs=ps.keep_jobs,
        operator_token=ps.operator_token,
        coordinator=ps.coordinator,
    )
    if policy is not None:
        for job in server.jobs.restore_all(policy.directory):
            held = server.job(job)
            step = held.job.step if held is not None else "?"
            click.echo(f"resumed job {job} from a checkpoint in {policy.directory / job}: step {step}")
    return server


def _peer_security(replicated: bool, token_file: Path | None, tls: TlsFiles) -> Security:
    """How a parameter-server replica reaches and admits the others of its slot (``--peer-*``)."""
    if replicated and token_file is None:
        raise click.UsageError(
            "--backup and --standby need --peer-token-file: a secret the replicas of the slot share, "
            "without which any client could demote or fence a primary (e.g. `head -c 32 /dev/urandom "
            "| base64 > peer.token; chmod 600 peer.token`)"
        )
    has_tls = tls.ca is not None or tls.cert is not None or tls.key is not None
    return Security(tls if has_tls else None, load_token(token_file) if token_file else None)


def _ps(
    *,
    workers: int,
    wait_timeout: float,
    heartbeat_timeout: float,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    checkpoint_seconds: float,
    keep_jobs: bool,
    max_jobs: int,
    backups: tuple[str, ...],
    standby: bool,
    failover_timeout: float,
    peer_token_file: Path | None,
    operator_token_file: Path | None,
    peer_tls_ca: Path | None,
    peer_tls_cert: Path | None,
    peer_tls_key: Path | None,
    threads: int | None,
    coordinator: str | None,
    slot: str | None,
    advertise: str | None,
    lease_ttl: float,
    coordinator_user: str | None,
    coordinator_password_file: Path | None,
    coordinator_tls_ca: Path | None,
    coordinator_tls_cert: Path | None,
    coordinator_tls_key: Path | None,
) -> PsOptions:
    peer = _peer_security(
        bool(backups) or standby, peer_token_file, TlsFiles(peer_tls_cert, peer_tls_key, peer_tls_ca)
    )
    coordination = _coordination(
        url=coordinator, slot=slot, advertise=advertise, ttl=lease_ttl, user=coordinator_user,
        password_file=coordinator_password_file,
        tls=TlsFiles(coordinator_tls_cert, coordinator_tls_key, coordinator_tls_ca),
    )  # fmt: skip
    operator = load_token(operator_token_file) if operator_token_file else None
    return PsOptions(
        workers,
        wait_timeout,
        heartbeat_timeout,
        checkpoint_dir,
        checkpoint_every,
        checkpoint_seconds,
        keep_jobs,
        max_jobs,
        backups,
        standby,
        failover_timeout,
        peer,
        operator,
        threads,
        coordination,
    )


def _coordination(
    *,
    url: str | None,
    slot: str | None,
    advertise: str | None,
    ttl: float,
    user: str | None,
    password_file: Path | None,
    tls: TlsFiles,
) -> Coordination | None:
    """``--coordinator`` and its flags, checked together; None without ``--coordinator``."""
    has_tls = tls.ca is not None or tls.cert is not None or tls.key is not None
    if url is None:
        if slot or advertise or user or password_file or has_tls:
            raise click.UsageError("--slot, --advertise and --coordinator-* need --coordinator URL")
        return None
    if slot is None:
        raise click.UsageError(
            "--coordinator needs --slot NAME: the replica slot (the same on each of its replicas)"
        )
    if (user is None) != (password_file is None):
        raise click.UsageError("--coordinator-user and --coordinator-password-file go together")
    from tensorwire.ps import Coordination

    password = load_token(password_file) if password_file is not None else None
    try:
        return Coordination(url, slot, advertise, ttl, tls if has_tls else None, user, password)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


ps_options = option_group(
    "parameter_server",
    _ps,
    click.option(
        "--workers",
        type=click.IntRange(min=0),
        default=1,
        show_default=True,
        help="Parameter server: the world size gRPC GradientService callers get when they send none "
        "(1: a call without metadata gets its own gradient back; 0: callers must send world-size).",
    ),
    click.option(
        "--wait-timeout",
        type=click.FloatRange(min=0.01),
        default=120.0,
        show_default=True,
        help="Parameter server: most seconds a pull or an allreduce waits for the other workers.",
    ),
    click.option(
        "--heartbeat-timeout",
        type=click.FloatRange(min=0),
        default=10.0,
        show_default=True,
        help="Parameter server: drop a worker not heard from this long (0: never), so sync steps go on.",
    ),
    click.option(
        "--checkpoint-dir",
        type=click.Path(file_okay=False, path_type=Path),
        help="Parameter server: write checkpoints here (and at SIGTERM); resume from the newest at start.",
    ),
    click.option(
        "--checkpoint-every",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Parameter server: a checkpoint every this many updates (0: not by count).",
    ),
    click.option(
        "--checkpoint-seconds",
        type=click.FloatRange(min=0),
        default=0.0,
        show_default=True,
        help="Parameter server: a checkpoint at the first update this long after the last (0: not by time).",
    ),
    click.option(
        "--keep-jobs",
        is_flag=True,
        help="Parameter server: keep a job's state when its last worker leaves (for a restart of its "
        "workers); by default the job ends: its last checkpoint is written and its memory freed.",
    ),
    click.option(
        "--max-jobs",
        type=click.IntRange(min=1),
        default=8,
        show_default=True,
        help="Parameter server: the most jobs held at once (job ids are the workers' choice); a new "
        "one beyond them is refused until a job ends (`tensorwire ps end JOB`).",
    ),
    click.option(
        "--backup",
        "backups",
        metavar="URL",
        multiple=True,
        callback=url_param,
        help="Parameter server: a backup (started with --standby) each change goes to first (repeatable).",
    ),
    click.option(
        "--standby",
        is_flag=True,
        help="Parameter server: be a backup; take over when the primary is silent for --failover-timeout.",
    ),
    click.option(
        "--failover-timeout",
        type=click.FloatRange(min=0.1),
        default=2.0,
        show_default=True,
        help="Parameter server (--standby): seconds without a word from the primary before taking over.",
    ),
    click.option(
        "--peer-token-file",
        type=FILE,
        help="Parameter server: the secret the replicas of one slot share (not the clients' token); "
        "required with --backup/--standby. Only a connection that offers it may replicate.",
    ),
    click.option(
        "--operator-token-file",
        type=FILE,
        help="Parameter server: the operator's secret (not the clients' token): `ps end "
        "--operator-token-file` with it ends any job, also one its workers started with a job token.",
    ),
    click.option(
        "--peer-tls-ca", type=FILE, help="Parameter server: CA of the tls:// --backup servers' certificates."
    ),
    click.option(
        "--peer-tls-cert",
        type=FILE,
        help="Parameter server: client certificate for tls:// backups that require one.",
    ),
    click.option("--peer-tls-key", type=FILE, help="The private key of --peer-tls-cert."),
    click.option(
        "--threads",
        type=click.IntRange(min=1),
        default=None,
        help="Parameter server: torch threads for the optimizer [default: half the cores, at most 4].",
    ),
    click.option(
        "--coordinator",
        metavar="URL",
        help="Parameter server: etcd://HOST:2379[,HOST:2379...]/PREFIX (etcds:// for TLS): the replica "
        "holding the slot's lease there is its primary (every replica of the slot starts as a backup).",
    ),
    click.option(
        "--slot",
        metavar="NAME",
        help="Parameter server (--coordinator): this replica's slot, the same on each of its replicas.",
    ),
    click.option(
        "--advertise",
        metavar="URL",
        callback=lambda ctx, param, value: None if value is None else url_param(ctx, param, value),
        help="Parameter server (--coordinator): the URL the slot's peers (their --backup) and workers "
        "reach this server at [default: the first --listen URL].",
    ),
    click.option(
        "--lease-ttl",
        type=click.FloatRange(min=1, max=3600),
        default=3.0,
        show_default=True,
        help="Parameter server (--coordinator): seconds a primary's lease lasts without a renewal.",
    ),
    click.option(
        "--coordinator-user", metavar="NAME", help="Parameter server: the etcd user (etcd's own auth)."
    ),
    click.option(
        "--coordinator-password-file",
        type=FILE,
        help="Parameter server: the etcd user's password, in a file.",
    ),
    click.option(
        "--coordinator-tls-ca", type=FILE, help="Parameter server: CA of the etcd servers (etcds://)."
    ),
    click.option(
        "--coordinator-tls-cert", type=FILE, help="Parameter server: client certificate for etcd (etcds://)."
    ),
    click.option("--coordinator-tls-key", type=FILE, help="The private key of --coordinator-tls-cert."),
)

# The flags above, for the message of a `tensorwire serve` given one of them.
PS_FLAGS = flags_of(ps_options)
