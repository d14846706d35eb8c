"""The options of ``tensorwire serve`` and ``tensorwire ps serve``, in groups: each group is a
decorator that adds its flags to a command and hands the command one object built from them
(``option_group``), so a command's signature names what it runs, not 44 flags.

``server_options`` gathers the store's groups into the one ``ServerOptions`` (``server/options.py``)
that ``Server(options)`` reads. The server's own page (``dashboard_options``) is in ``cli/serve.py``;
the parameter server's group is in ``cli/ps_options.py``, on ``ps serve`` only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from tensorwire import topology
from tensorwire.cli.options import DEFAULT_URL, FILE, parse_url, size_param, url_param
from tensorwire.security import TlsFiles, load_token
from tensorwire.server.options import (
    ConnectionOptions,
    MetricsOptions,
    ServerOptions,
    StoreOptions,
    UploadOptions,
)
from tensorwire.store.generation_config import (
    DEFAULT_KEEP,
    DEFAULT_MAX_LEASE_SECONDS,
    FLAGS,
    GenerationConfig,
)
from tensorwire.store.memory import DEFAULT_MAX_TENSORS
from tensorwire.store.uploads import DEFAULT_MAX_UPLOADS, DEFAULT_UPLOADS_PER_CLIENT
from tensorwire.transport.spin import MAX_SPIN

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def option_group(
    target: str, build: Callable[..., Any], *options: Decorator, names: tuple[str, ...] = ()
) -> Decorator:
    """A decorator that adds ``options`` to a command and, when it runs, passes it
    ``target=build(**those options' values)`` in their place. ``names``: further arguments ``build``
    takes, made by groups applied below this one."""
    taken = (*_param_names(options), *names)

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def grouped(*args: Any, **kwargs: Any) -> Any:
            kwargs[target] = build(**{name: kwargs.pop(name) for name in taken})
            return command(*args, **kwargs)

        decorated: Callable[..., Any] = grouped
        for option in reversed(options):
            decorated = option(decorated)
        return decorated

    return decorate


def flags_of(group: Decorator) -> frozenset[str]:
    """Every flag ``group`` adds (``--capacity``, ...)."""

    def probe() -> None: ...

    params: list[click.Parameter] = getattr(group(probe), "__click_params__", [])
    return frozenset(flag for param in params for flag in param.opts)


def _param_names(options: tuple[Decorator, ...]) -> list[str]:
    """The argument names click gives the values of ``options``."""

    def probe() -> None: ...

    for option in options:
        option(probe)
    return [str(param.name) for param in getattr(probe, "__click_params__", []) if param.expose_value]


# -- parameter callbacks ---------------------------------------------------------------------------
def _grpc_param(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``HOST:PORT`` (or ``grpc://HOST:PORT``) for --grpc-listen."""
    try:
        return tuple(parse_url(v if "://" in v else f"grpc://{v}") for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _rack_param(ctx: click.Context, param: click.Parameter, value: str | None) -> topology.Location:
    """``--rack``: this process's location, the rack given or ``$TENSORWIRE_RACK`` (read now)."""
    try:
        return topology.here(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


# -- where it listens ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Listen:
    """``--listen``, ``--grpc-listen`` and ``--ready-file``: where the server serves, and where it
    says so once it does."""

    urls: tuple[str, ...] = (DEFAULT_URL,)
    ready_file: Path | None = None


def _listen(listen: tuple[str, ...], grpc_listen: tuple[str, ...], ready_file: Path | None) -> Listen:
    return Listen(listen + grpc_listen, ready_file)


listen_options = option_group(
    "listen",
    _listen,
    click.option(
        "--listen",
        "listen",
        metavar="URL",
        callback=url_param,
        multiple=True,
        default=[DEFAULT_URL],
        show_default=True,
        help="Address to serve on (repeatable); HOST:PORT means tcp://HOST:PORT, port 0 picks a free one.",
    ),
    click.option(
        "--grpc-listen",
        "grpc_listen",
        metavar="HOST:PORT",
        callback=_grpc_param,
        multiple=True,
        help="Also serve the gRPC TensorService here (repeatable), on the same store.",
    ),
    click.option(
        "--ready-file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Once listening, write the actual addresses here, one per line.",
    ),
)


# -- the store, connections, uploads ---------------------------------------------------------------
store_options = option_group(
    "store",
    StoreOptions,
    click.option(
        "--capacity",
        metavar="SIZE",
        callback=size_param,
        default="8GiB",
        show_default=True,
        help="Most bytes the store holds: 8GiB, 512MiB, 1.5GB, or bytes.",
    ),
    click.option(
        "--data-dir", type=click.Path(file_okay=False, path_type=Path), help="Keep tensors on disk here."
    ),
    click.option(
        "--max-tensors",
        type=click.IntRange(min=1),
        default=DEFAULT_MAX_TENSORS,
        show_default=True,
        help="Most tensors the store holds (each name also costs 1 KiB + its length of --capacity).",
    ),
)

connection_options = option_group(
    "connections",
    ConnectionOptions,
    click.option(
        "--stall-timeout",
        type=click.FloatRange(min=0.01),
        default=60.0,
        show_default=True,
        help="Seconds a client may make no progress in the middle of a request before it is cut off.",
    ),
    click.option(
        "--max-connections",
        type=click.IntRange(min=1),
        default=1024,
        show_default=True,
        help="Refuse connections beyond this many.",
    ),
    click.option(
        "--idle-timeout",
        type=click.FloatRange(min=0.01),
        default=900.0,
        show_default=True,
        help="Close connections idle this many seconds (clients reconnect on their next call).",
    ),
    click.option(
        "--busy-poll",
        type=click.FloatRange(min=0, max=MAX_SPIN),
        default=0.0,
        show_default=True,
        metavar="SECONDS",
        help="After each request, a connection's wait for the next one polls "
        "without sleeping this long first (a CPU gone idle wakes ~100 us late on a VM); costs CPU. "
        "0: never.",
    ),
    click.option(
        "--auth-timeout",
        type=click.FloatRange(min=0.01),
        default=5.0,
        show_default=True,
        help="Close a connection whose TLS handshake and first frame (its HELLO with the token) are "
        "not in within this many seconds.",
    ),
)


def _uploads(max_uploads: int, uploads_per_client: int, resumable_min_bytes: int) -> UploadOptions:
    return UploadOptions(max_uploads, uploads_per_client, resumable_min_bytes)


upload_options = option_group(
    "uploads",
    _uploads,
    click.option(
        "--max-uploads",
        type=click.IntRange(min=1),
        default=DEFAULT_MAX_UPLOADS,
        show_default=True,
        help="Most resumable and striped uploads open at once; a new one replaces the oldest idle one.",
    ),
    click.option(
        "--uploads-per-client",
        type=click.IntRange(min=1),
        default=DEFAULT_UPLOADS_PER_CLIENT,
        show_default=True,
        help="Most uploads open per client host; a new one replaces its oldest idle one.",
    ),
    click.option(
        "--resumable-min-bytes",
        metavar="SIZE",
        callback=size_param,
        default="16MiB",
        show_default=True,
        help="Smaller resumable puts keep no upload state (served as plain puts).",
    ),
)


# -- generations -----------------------------------------------------------------------------------
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


def _bound(name: str, text: str) -> Decorator:
    default = getattr(GenerationConfig(), name)
    kind = click.FloatRange(min=0.01) if isinstance(default, float) else click.IntRange(min=1)
    return click.option(FLAGS[name], name, type=kind, default=default, show_default=True, help=text)


def _generations(keep_generations: int, max_lease_seconds: float, **bounds: Any) -> GenerationConfig:
    return GenerationConfig(keep=keep_generations, max_lease_seconds=max_lease_seconds, **bounds)


generation_options = option_group(
    "generations",
    _generations,
    click.option(
        "--keep-generations",
        type=click.IntRange(min=1),
        default=DEFAULT_KEEP,
        show_default=True,
        help="Generations (client.publish) kept per prefix, besides those a reader holds a lease on.",
    ),
    click.option(
        "--max-lease-seconds",
        type=click.FloatRange(min=0.01),
        default=DEFAULT_MAX_LEASE_SECONDS,
        show_default=True,
        help="Longest lease on a generation a reader gets (a longer one is cut to this).",
    ),
    *(_bound(name, text) for name, text in _GENERATION_BOUNDS),
)


# -- TLS, token, metrics ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Secured:
    """``--tls-cert``/``--tls-key``/``--tls-client-ca`` and ``--token-file``, read."""

    tls: TlsFiles | None = None
    token: str | None = None


def _secured(
    tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None, token_file: Path | None
) -> Secured:
    tls = TlsFiles(tls_cert, tls_key, tls_client_ca) if tls_cert or tls_key or tls_client_ca else None
    return Secured(tls, load_token(token_file) if token_file else None)


security_server_options = option_group(
    "secured",
    _secured,
    click.option("--tls-cert", type=FILE, help="Server certificate (PEM) for tls:// and grpcs:// addresses."),
    click.option("--tls-key", type=FILE, help="Its private key (PEM)."),
    click.option("--tls-client-ca", type=FILE, help="Require client certificates signed by this CA (mTLS)."),
    click.option("--token-file", type=FILE, help="Require this shared token from every client."),
)


def _metrics(
    metrics_port: int | None,
    metrics_host: str | None,
    metrics_connections: int,
    metrics_token_file: Path | None,
) -> MetricsOptions:
    if metrics_token_file is not None and metrics_port is None:
        raise click.UsageError("--metrics-token-file needs --metrics-port (it is the metrics page's secret)")
    token = load_token(metrics_token_file) if metrics_token_file else None
    return MetricsOptions(metrics_port, metrics_host, metrics_connections, token)


metrics_options = option_group(
    "metrics",
    _metrics,
    click.option(
        "--metrics-port",
        type=click.IntRange(min=0, max=65535),
        default=None,
        help="Serve Prometheus metrics on http://HOST:PORT/metrics (0: a free port; STATUS reports it).",
    ),
    click.option(
        "--metrics-host", metavar="HOST", default=None, help="Bind metrics here [default: the --listen host]."
    ),
    click.option(
        "--metrics-connections",
        type=click.IntRange(min=1),
        default=16,
        show_default=True,
        help="Most scrapes of the metrics endpoint served at once; more are closed at once.",
    ),
    click.option(
        "--metrics-token-file",
        type=FILE,
        help="Prometheus's read-only secret (not --token-file): only a scrape bearing it "
        "(Authorization: Bearer) sees job ids and prefixes; on a server with a token or client "
        "certificates the others see them as pseudonyms.",
    ),
)


def _server(
    *,
    store: StoreOptions,
    connections: ConnectionOptions,
    uploads: UploadOptions,
    generations: GenerationConfig,
    secured: Secured,
    metrics: MetricsOptions,
    location: topology.Location,
) -> ServerOptions:
    check_secrets([("--token-file", secured.token), ("--metrics-token-file", metrics.token)])
    return ServerOptions(
        store=store,
        connections=connections,
        uploads=uploads,
        metrics=metrics,
        generations=generations,
        location=location,
        tls=secured.tls,
        token=secured.token,
    )


def check_secrets(secrets: list[tuple[str, str | None]]) -> None:
    """Each secret a server holds opens something else (clients, replicas, the operator's ends, the
    metrics page): UsageError where one file holds the same secret as an earlier one."""
    for i, (flag, secret) in enumerate(secrets):
        same = [earlier for earlier, other in secrets[:i] if secret is not None and secret == other]
        if same:
            raise click.UsageError(f"{flag} must differ from {same[0]}: each file must hold another secret")


def server_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Every flag of the store server, handed to ``command`` as one ``options: ServerOptions``."""
    rack = click.option(
        "--rack",
        "location",
        metavar="LABEL",
        callback=_rack_param,
        default=None,
        help=f"This server's rack (or zone) label, shown in HELLO and STATUS [default: "
        f"${topology.RACK_ENV}]; its host label is ${topology.HOST_ENV}, else the hostname.",
    )
    parts = ("store", "connections", "uploads", "generations", "secured", "metrics")
    command = option_group("options", _server, rack, names=parts)(command)
    for group in (
        metrics_options,
        security_server_options,
        generation_options,
        upload_options,
        connection_options,
        store_options,
    ):
        command = group(command)
    return command
