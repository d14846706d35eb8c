"""``tensorwire serve`` (also ``tensorwire ps serve``) and ``tensorwire certs``: run a server, and
make the development certificates a tls:// one needs.

``serve`` runs one process: a tensor store, which is also a parameter server (``tensorwire.ps``) and
the node side of ``tensorwire dataset`` (``DigestService``), until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import torch

from tensorwire import logs, topology
from tensorwire._aio import run
from tensorwire._fs import write_file
from tensorwire.cli.options import DEFAULT_URL, FILE, parse_url, size_param, url_param
from tensorwire.dashboard.guard import Limits
from tensorwire.security import (
    DEV_CERT_HOSTS,
    Security,
    TlsFiles,
    check_cert_host,
    is_loopback,
    load_token,
    server_ssl_context,
    write_dev_certs,
    write_reader_certs,
)
from tensorwire.server.core import Server
from tensorwire.store import TensorStore
from tensorwire.store.generation_config import (
    DEFAULT_KEEP,
    DEFAULT_MAX_LEASE_SECONDS,
    FLAGS,
    GenerationConfig,
)
from tensorwire.store.memory import DEFAULT_MAX_TENSORS
from tensorwire.store.uploads import DEFAULT_MAX_UPLOADS, DEFAULT_UPLOADS_PER_CLIENT
from tensorwire.transport.spin import MAX_SPIN


def _grpc_param(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``HOST:PORT`` (or ``grpc://HOST:PORT``) for --grpc-listen."""
    try:
        return tuple(parse_url(v if "://" in v else f"grpc://{v}") for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _host_param(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(check_cert_host(v) for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _networks_param(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``--relay-networks``: CIDRs, checked now."""
    from tensorwire.broadcast.coordinator import parse_networks

    try:
        return tuple(str(network) for network in parse_networks(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _rack_param(ctx: click.Context, param: click.Parameter, value: str | None) -> topology.Location:
    """``--rack``: this process's location, the rack given or ``$TENSORWIRE_RACK`` (read now)."""
    try:
        return topology.here(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


# The bounds on what clients make the server hold for generations (GenerationConfig; every refusal
# names its flag): (field, help). Their defaults are GenerationConfig's own.
_GENERATION_BOUNDS = (
    ("max_prefixes", "Most prefixes with generations, server-wide (GEN_DROP frees one)."),
    ("prefixes_per_client", "Most prefixes with generations one client host makes."),
    ("leases_per_owner", "Most leases (and generation views) one connection holds on generations."),
    ("leases_per_client", "Most leases on generations one client host holds, over all its connections."),
    ("max_waiters", "Most generation waits (client.wait) parked at once, server-wide."),
    ("waiters_per_owner", "Most generation waits parked on one connection."),
    ("waiters_per_client", "Most generation waits parked from one client host."),
    (
        "max_wait_seconds",
        "Longest a generation wait or a multi-part publish waits (at most half --idle-timeout).",
    ),
    ("max_transactions", "Most multi-part publishes (sharded puts) open at once, server-wide."),
    ("transactions_per_owner", "Most multi-part publishes one connection has parts in."),
    ("transactions_per_client", "Most multi-part publishes one client host has parts in."),
    ("max_parts", "Most parts (ranks) in one multi-part publish."),
)


def _collect_bounds(ctx: click.Context, param: click.Parameter, value: object) -> object:
    """Gather the generation bounds into one ``generation_limits`` argument."""
    assert param.name is not None
    ctx.params.setdefault("generation_limits", {})[param.name] = value
    return value


def generation_bounds(command: Any) -> Any:
    """``--max-prefixes`` ... ``--max-parts`` (``_GENERATION_BOUNDS``), each a GenerationConfig
    field, passed to ``serve`` together as ``generation_limits``."""
    defaults = GenerationConfig()
    for name, text in reversed(_GENERATION_BOUNDS):
        default = getattr(defaults, name)
        kind = click.FloatRange(min=0.01) if isinstance(default, float) else click.IntRange(min=1)
        option = click.option(FLAGS[name], name, type=kind, default=default, show_default=True, help=text,
                              callback=_collect_bounds, expose_value=False)  # fmt: skip
        command = option(command)
    return command


@click.command()
@click.option(
    "--listen", "listen", metavar="URL", callback=url_param, multiple=True,
    default=[DEFAULT_URL], show_default=True,
    help="Address to serve on (repeatable); HOST:PORT means tcp://HOST:PORT, port 0 picks a free one.",
)  # fmt: skip
@click.option(
    "--grpc-listen", "grpc_listen", metavar="HOST:PORT", callback=_grpc_param, multiple=True,
    help="Also serve the gRPC TensorService here (repeatable), on the same store.",
)  # fmt: skip
@click.option(
    "--capacity", metavar="SIZE", callback=size_param, default="8GiB", show_default=True,
    help="Most bytes the store holds: 8GiB, 512MiB, 1.5GB, or bytes.",
)  # fmt: skip
@click.option(
    "--data-dir", type=click.Path(file_okay=False, path_type=Path), help="Keep tensors on disk here."
)
@click.option(
    "--ready-file", type=click.Path(dir_okay=False, path_type=Path),
    help="Once listening, write the actual addresses here, one per line.",
)  # fmt: skip
@click.option(
    "--stall-timeout", type=click.FloatRange(min=0.01), default=60.0, show_default=True,
    help="Seconds a client may make no progress in the middle of a request before it is cut off.",
)  # fmt: skip
@click.option(
    "--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
    help="Refuse connections beyond this many.",
)  # fmt: skip
@click.option(
    "--idle-timeout", type=click.FloatRange(min=0.01), default=900.0, show_default=True,
    help="Close connections idle this many seconds (clients reconnect on their next call).",
)  # fmt: skip
@click.option(
    "--busy-poll", type=click.FloatRange(min=0, max=MAX_SPIN), default=0.0, show_default=True,
    metavar="SECONDS", help="After each request, a connection's wait for the next one polls without "
    "sleeping this long first (a CPU gone idle wakes ~100 us late on a VM); costs CPU. 0: never.",
)  # fmt: skip
@click.option(
    "--auth-timeout", type=click.FloatRange(min=0.01), default=5.0, show_default=True,
    help="Close a connection whose TLS handshake and first frame (its HELLO with the token) are not "
    "in within this many seconds.",
)  # fmt: skip
@click.option(
    "--max-tensors", type=click.IntRange(min=1), default=DEFAULT_MAX_TENSORS, show_default=True,
    help="Most tensors the store holds (each name also costs 1 KiB + its length of --capacity).",
)  # fmt: skip
@click.option(
    "--max-uploads", type=click.IntRange(min=1), default=DEFAULT_MAX_UPLOADS, show_default=True,
    help="Most resumable and striped uploads open at once; a new one replaces the oldest idle one.",
)  # fmt: skip
@click.option(
    "--uploads-per-client", type=click.IntRange(min=1), default=DEFAULT_UPLOADS_PER_CLIENT,
    show_default=True, help="Most uploads open per client host; a new one replaces its oldest idle one.",
)  # fmt: skip
@click.option(
    "--resumable-min-bytes", metavar="SIZE", callback=size_param, default="16MiB", show_default=True,
    help="Smaller resumable puts keep no upload state (served as plain puts).",
)  # fmt: skip
@click.option(
    "--keep-generations", type=click.IntRange(min=1), default=DEFAULT_KEEP, show_default=True,
    help="Generations (client.publish) kept per prefix, besides those a reader holds a lease on.",
)  # fmt: skip
@click.option(
    "--max-lease-seconds", type=click.FloatRange(min=0.01), default=DEFAULT_MAX_LEASE_SECONDS,
    show_default=True, help="Longest lease on a generation a reader gets (a longer one is cut to this).",
)  # fmt: skip
@generation_bounds
@click.option("--tls-cert", type=FILE, help="Server certificate (PEM) for tls:// and grpcs:// addresses.")
@click.option("--tls-key", type=FILE, help="Its private key (PEM).")
@click.option("--tls-client-ca", type=FILE, help="Require client certificates signed by this CA (mTLS).")
@click.option("--token-file", type=FILE, help="Require this shared token from every client.")
@click.option(
    "--workers", type=click.IntRange(min=0), default=1, show_default=True,
    help="Parameter server: the world size gRPC GradientService callers get when they send none "
    "(1: a call without metadata gets its own gradient back; 0: callers must send world-size).",
)  # fmt: skip
@click.option(
    "--wait-timeout", type=click.FloatRange(min=0.01), default=120.0, show_default=True,
    help="Parameter server: most seconds a pull or an allreduce waits for the other workers.",
)  # fmt: skip
@click.option(
    "--heartbeat-timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
    help="Parameter server: drop a worker not heard from this long (0: never), so sync steps go on.",
)  # fmt: skip
@click.option(
    "--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path),
    help="Parameter server: write checkpoints here (and at SIGTERM); resume from the newest at start.",
)  # fmt: skip
@click.option(
    "--checkpoint-every", type=click.IntRange(min=0), default=0, show_default=True,
    help="Parameter server: a checkpoint every this many updates (0: not by count).",
)  # fmt: skip
@click.option(
    "--checkpoint-seconds", type=click.FloatRange(min=0), default=0.0, show_default=True,
    help="Parameter server: a checkpoint at the first update this long after the last (0: not by time).",
)  # fmt: skip
@click.option(
    "--keep-jobs", is_flag=True,
    help="Parameter server: keep a job's state when its last worker leaves (for a restart of its "
    "workers); by default the job ends: its last checkpoint is written and its memory freed.",
)  # fmt: skip
@click.option(
    "--max-jobs", type=click.IntRange(min=1), default=8, show_default=True,
    help="Parameter server: the most jobs held at once (job ids are the workers' choice); a new one "
    "beyond them is refused until a job ends (`tensorwire ps end JOB`).",
)  # fmt: skip
@click.option(
    "--backup", "backups", metavar="URL", multiple=True, callback=url_param,
    help="Parameter server: a backup (started with --standby) each change goes to first (repeatable).",
)  # fmt: skip
@click.option(
    "--standby", is_flag=True,
    help="Parameter server: be a backup; take over when the primary is silent for --failover-timeout.",
)  # fmt: skip
@click.option(
    "--failover-timeout", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
    help="Parameter server (--standby): seconds without a word from the primary before taking over.",
)  # fmt: skip
@click.option(
    "--peer-token-file", type=FILE,
    help="Parameter server: the secret the replicas of one slot share (not the clients' token); "
    "required with --backup/--standby. Only a connection that offers it may replicate.",
)  # fmt: skip
@click.option(
    "--operator-token-file", type=FILE,
    help="Parameter server: the operator's secret (not the clients' token): `ps end --operator-token-file` "
    "with it ends any job, also one its workers started with a job token.",
)  # fmt: skip
@click.option(
    "--peer-tls-ca", type=FILE, help="Parameter server: CA of the tls:// --backup servers' certificates."
)
@click.option(
    "--peer-tls-cert",
    type=FILE,
    help="Parameter server: client certificate for tls:// backups that require one.",
)
@click.option("--peer-tls-key", type=FILE, help="The private key of --peer-tls-cert.")
@click.option(
    "--threads", type=click.IntRange(min=1), default=None,
    help="Parameter server: torch threads for the optimizer [default: half the cores, at most 4].",
)  # fmt: skip
@click.option(
    "--metrics-port", type=click.IntRange(min=0, max=65535), default=None,
    help="Serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port; STATUS reports it).",
)  # fmt: skip
@click.option(
    "--metrics-host", metavar="HOST", default=None, help="Bind metrics here [default: the --listen host]."
)
@click.option(
    "--metrics-connections", type=click.IntRange(min=1), default=16, show_default=True,
    help="Most scrapes of the metrics endpoint served at once; more are closed at once.",
)  # fmt: skip
@click.option(
    "--metrics-token-file", type=FILE,
    help="Prometheus's read-only secret (not --token-file): only a scrape bearing it (Authorization: "
    "Bearer) sees job ids and prefixes; on a server with a token or client certificates the others "
    "see them as pseudonyms.",
)  # fmt: skip
@click.option(
    "--dashboard-port", type=click.IntRange(min=0, max=65535), default=None,
    help="Serve this server's live web page on http://--dashboard-host:PORT/ (`tensorwire dashboard`).",
)  # fmt: skip
@click.option(
    "--dashboard-host", metavar="HOST", default="127.0.0.1", show_default=True,
    help="Bind the page here; beyond loopback it needs --token-file (a browser logs in with it) and "
    "--tls-cert (HTTPS only; with --tls-client-ca browsers need client certificates, as clients do).",
)  # fmt: skip
@click.option(
    "--dashboard-allowed-host", "dashboard_allowed_hosts", multiple=True, metavar="NAME",
    help="Also answer page requests for this Host name (repeatable; on loopback only localhost, "
    "127.0.0.1 and ::1 are answered otherwise: DNS rebinding).",
)  # fmt: skip
@click.option(
    "--dashboard-max-connections", type=click.IntRange(min=1), default=Limits.max_connections,
    show_default=True, help="The page's HTTP connections open at once (TLS handshakes included).",
)  # fmt: skip
@click.option(
    "--dashboard-max-streams", type=click.IntRange(min=1), default=Limits.max_streams, show_default=True,
    help="The page's live event streams (open pages) at once, all browsers together.",
)  # fmt: skip
@click.option(
    "--relay-networks", "relay_networks", metavar="CIDR", multiple=True, callback=_networks_param,
    help="Relay readers (Subscriber) may register a relay address in this network other than the IP "
    "their connection comes from: readers behind NAT, or relaying on another interface (repeatable; "
    "by default only that IP; loopback, link-local and unspecified addresses never).",
)  # fmt: skip
@click.option(
    "--rack", "location", metavar="LABEL", callback=_rack_param, default=None,
    help=f"This server's rack (or zone) label, shown in HELLO and STATUS [default: ${topology.RACK_ENV}]; "
    f"its host label is ${topology.HOST_ENV}, else the hostname.",
)  # fmt: skip
@click.option(
    "--log-level", type=click.Choice(logs.LEVELS, case_sensitive=False), default=None,
    help="The same as `tensorwire --log-level` (kept for existing scripts).",
)  # fmt: skip
def serve(
    *,
    listen: tuple[str, ...],
    grpc_listen: tuple[str, ...],
    capacity: int,
    data_dir: Path | None,
    ready_file: Path | None,
    stall_timeout: float,
    max_connections: int,
    idle_timeout: float,
    busy_poll: float,
    auth_timeout: float,
    max_tensors: int,
    max_uploads: int,
    uploads_per_client: int,
    resumable_min_bytes: int,
    keep_generations: int,
    max_lease_seconds: float,
    generation_limits: dict[str, Any],
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    token_file: Path | None,
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
    metrics_port: int | None,
    metrics_host: str | None,
    metrics_connections: int,
    metrics_token_file: Path | None,
    dashboard_port: int | None,
    dashboard_host: str,
    dashboard_allowed_hosts: tuple[str, ...],
    dashboard_max_connections: int,
    dashboard_max_streams: int,
    relay_networks: tuple[str, ...],
    location: topology.Location,
    log_level: str | None,
) -> None:
    """Serve a tensor store, which is also a parameter server, until SIGINT or SIGTERM."""
    from tensorwire.broadcast.coordinator import RelayCoordinator
    from tensorwire.dataset.digest import DigestService
    from tensorwire.ps import CheckpointPolicy, ParamServer

    # The optimizer's element-wise steps are memory-bound: a few threads get most of the speed, and
    # more (spinning OpenMP threads) take cores from the workers that often share the host.
    torch.set_num_threads(threads or max(1, min(4, (os.cpu_count() or 2) // 2)))
    if log_level is not None:
        logging.getLogger().setLevel(log_level.upper())
    tls = TlsFiles(tls_cert, tls_key, tls_client_ca) if tls_cert or tls_key or tls_client_ca else None
    security = Security(tls, load_token(token_file) if token_file else None)
    peer = _peer_security(
        bool(backups) or standby, peer_token_file, TlsFiles(peer_tls_cert, peer_tls_key, peer_tls_ca)
    )
    if peer.token is not None and peer.token == security.token:
        raise click.UsageError("--peer-token-file must hold another secret than --token-file")
    operator = load_token(operator_token_file) if operator_token_file else None
    if operator is not None and operator in (security.token, peer.token):
        raise click.UsageError("--operator-token-file must differ from --token-file and --peer-token-file")
    if metrics_token_file is not None and metrics_port is None:
        raise click.UsageError("--metrics-token-file needs --metrics-port (it is the metrics page's secret)")
    scrape = load_token(metrics_token_file) if metrics_token_file else None
    if scrape is not None and scrape in (security.token, peer.token, operator):
        raise click.UsageError(
            "--metrics-token-file must differ from --token-file, --peer-token-file and --operator-token-file"
        )
    store = TensorStore(capacity, data_dir, max_tensors=max_tensors)
    policy = (
        CheckpointPolicy(checkpoint_dir, checkpoint_every, checkpoint_seconds) if checkpoint_dir else None
    )
    ps_server = ParamServer(
        wait_timeout,
        workers,
        capacity,
        heartbeat_timeout=heartbeat_timeout,
        checkpoints=policy,
        backups=backups,
        standby=standby,
        failover_timeout=failover_timeout,
        peer=peer,
        max_jobs=max_jobs,
        keep_jobs=keep_jobs,
        operator_token=operator,
    )
    if policy is not None:
        for job in ps_server.jobs.restore_all(policy.directory):
            held = ps_server.job(job)
            step = held.job.step if held is not None else "?"
            click.echo(f"resumed job {job} from a checkpoint in {policy.directory / job}: step {step}")
    server = Server(
        store,
        stall_timeout=stall_timeout,
        security=security,
        max_connections=max_connections,
        idle_timeout=idle_timeout,
        busy_poll=busy_poll,
        auth_timeout=auth_timeout,
        extensions=[ps_server, DigestService(store)],
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        metrics_connections=metrics_connections,
        metrics_token=scrape,
        max_uploads=max_uploads,
        uploads_per_client=uploads_per_client,
        resumable_min_bytes=resumable_min_bytes,
        location=location,
        generations=GenerationConfig(
            keep=keep_generations, max_lease_seconds=max_lease_seconds, **generation_limits
        ),
    )
    RelayCoordinator.of(server, networks=relay_networks)  # readers of its generations relay them
    page_tls = TlsFiles(tls_cert, tls_key, tls_client_ca) if tls_cert and tls_key else None  # as clients
    allowed = dashboard_allowed_hosts
    limits = Limits(max_connections=dashboard_max_connections, max_streams=dashboard_max_streams,
                    flags="--dashboard-")  # fmt: skip
    page = None if dashboard_port is None else Page(dashboard_port, dashboard_host, page_tls, allowed, limits)
    if page is not None and not is_loopback(dashboard_host) and (security.token is None or page_tls is None):
        raise click.UsageError(
            f"--dashboard-host {dashboard_host} is beyond loopback: it needs --token-file and --tls-cert/"
            "--tls-key (a login over plain HTTP would send the token in the clear)"
        )
    run(_serve(server, listen + grpc_listen, ready_file, page))


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


@click.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--host", "hosts", multiple=True, metavar="NAME|IP", callback=_host_param,
    help="Also issue the server certificate for this DNS name or IP address, as clients on other "
    "hosts reach the server (repeatable; localhost, 127.0.0.1 and ::1 are always included).",
)  # fmt: skip
@click.option(
    "--reader", "readers", multiple=True, metavar="IP", callback=_host_param,
    help="Also issue a relay reader's certificate for the host at this address (reader-IP.pem: a "
    "server and a client certificate, as a Subscriber relaying over tls:// needs), signed by the CA "
    "in DIRECTORY, which is written first if there is none (repeatable).",
)  # fmt: skip
@click.option("--days", type=click.IntRange(min=1), default=365, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace certificates already in DIRECTORY.")
def certs(
    directory: Path, hosts: tuple[str, ...], readers: tuple[str, ...], days: int, overwrite: bool
) -> None:
    """Write a development CA and server/client certificates into DIRECTORY (not for production).

    A client checks that the name it connects to (tls://NAME:PORT) is in the server certificate:
    give every name and address other hosts use with --host, e.g. --host trainer-0 --host 10.0.0.5.
    A relay reader over tls:// needs a certificate naming its own host's address, valid as a server's
    and a client's: --reader 10.0.0.7 writes one (with a CA already in DIRECTORY, only that)."""
    if not readers or not (directory / "ca-key.pem").exists():
        _dev_certs(directory, hosts, days, overwrite)
    if readers:
        written = write_reader_certs(directory, readers, days, overwrite=overwrite)
        for role, path in written.items():
            click.echo(f"{role:10} {path}")
        cert, key = written[f"reader:{readers[0]}"], written[f"reader_key:{readers[0]}"]
        click.echo(f"reader: Subscriber(url, prefix, model, tls=TlsFiles(cert='{cert}', key='{key}', "
                   f"ca='{directory / 'ca.pem'}')) on {readers[0]}")  # fmt: skip


def _dev_certs(directory: Path, hosts: tuple[str, ...], days: int, overwrite: bool) -> None:
    names = tuple(dict.fromkeys([*DEV_CERT_HOSTS, *hosts]))
    written = write_dev_certs(directory, names, days, overwrite=overwrite)
    for role, path in written.items():
        click.echo(f"{role:10} {path}")
    click.echo(f"hosts:  {', '.join(names)}")
    host = (f"[{hosts[0]}]" if ":" in hosts[0] else hosts[0]) if hosts else "127.0.0.1"
    listen = "0.0.0.0" if hosts else "127.0.0.1"
    click.echo(f"serve:  tensorwire serve --listen tls://{listen}:7443 --tls-cert {written['server']} "
               f"--tls-key {written['server_key']}")  # fmt: skip
    click.echo(f"client: tensorwire ls --server tls://{host}:7443 --tls-ca {written['ca']}")


@dataclass(frozen=True)
class Page:
    """``--dashboard-port``: where the server's own page binds, and its TLS files (--tls-cert)."""

    port: int
    host: str
    tls: TlsFiles | None
    allowed_hosts: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)


async def _start_page(server: Server, page: Page) -> Any:
    """The server's own dashboard page, reading its state in this process (tensorwire.dashboard),
    on a thread and event loop of its own: its HTTP and streams cost the serving loop nothing."""
    from tensorwire.dashboard import sources
    from tensorwire.dashboard.app import Dashboard
    from tensorwire.dashboard.listen import PageThread

    tls = server_ssl_context(page.tls) if page.tls is not None else None
    urls = [[str(server.addresses[0])]] if server.addresses else [["local"]]
    dashboard = Dashboard(sources.local(server), urls, host=page.host, port=page.port, ssl_context=tls,
                          token=server.security.token, allowed_hosts=page.allowed_hosts,
                          limits=page.limits)  # fmt: skip
    thread = PageThread(dashboard)
    await asyncio.to_thread(thread.start)
    click.echo(f"tensorwire dashboard on {dashboard.url}")
    return thread


async def _serve(server: Server, urls: tuple[str, ...], ready_file: Path | None, page: Page | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dashboard: Any = None
    try:
        addresses = await server.start(*urls)
        for address in addresses:
            click.echo(f"tensorwire serving on {address}")  # click.echo flushes: a pipe reader sees it now
        if server.exporter is not None:
            click.echo(f"tensorwire metrics on {server.exporter.url}")
        dashboard = await _start_page(server, page) if page is not None else None
        if ready_file is not None:
            _write_atomic(ready_file, "".join(f"{a}\n" for a in addresses).encode())
        await stop.wait()
    finally:
        if dashboard is not None:
            await asyncio.to_thread(dashboard.close)
        await server.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a fresh temporary file and a rename, so a reader never sees a half-written file
    (and a link planted at either name is replaced, never written through)."""
    write_file(path, lambda f: f.write(data))
