"""``tensorwire serve`` and ``tensorwire certs``: run a server, and make the development
certificates a tls:// one needs.

``serve`` runs one process: a tensor store, which is also a parameter server (``tensorwire.ps``,
with its defaults; ``tensorwire ps serve`` takes its options) and the node side of ``tensorwire
dataset`` (``DigestService``), until SIGINT or SIGTERM. Its flags come in groups
(``cli/server_options.py``) that build one ``ServerOptions``; ``start`` builds and runs the server
for both commands.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import torch

from tensorwire import logs
from tensorwire._aio import run
from tensorwire._fs import write_file
from tensorwire._gc import freeze_loaded
from tensorwire.cli.ps_options import PS_FLAGS, PsOptions, param_server
from tensorwire.cli.server_options import Listen, listen_options, option_group, server_options
from tensorwire.dashboard.guard import Limits as PageLimits
from tensorwire.security import (
    DEV_CERT_HOSTS,
    TlsFiles,
    check_cert_host,
    is_loopback,
    server_ssl_context,
    write_dev_certs,
    write_reader_certs,
)
from tensorwire.server.core import Server
from tensorwire.server.options import ServerOptions


def _networks_param(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``--relay-networks``: CIDRs, checked now."""
    from tensorwire.broadcast.coordinator import parse_networks

    try:
        return tuple(str(network) for network in parse_networks(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


@dataclass(frozen=True)
class Page:
    """``--dashboard-*``: where the server's own page binds. It is served with the server's
    certificate (``--tls-cert``/``--tls-key``, and ``--tls-client-ca`` asks browsers for client
    certificates as clients are asked) and its token (a browser logs in with it)."""

    port: int
    host: str
    allowed_hosts: tuple[str, ...] = ()
    limits: PageLimits = field(default_factory=PageLimits)

    @staticmethod
    def tls(options: ServerOptions) -> TlsFiles | None:
        """The files the page serves HTTPS with: the server's, when it has a certificate and key."""
        return options.tls if options.tls and options.tls.cert and options.tls.key else None

    def check(self, options: ServerOptions) -> None:
        """UsageError unless the page can be served safely with ``options``."""
        if not is_loopback(self.host) and (options.token is None or self.tls(options) is None):
            raise click.UsageError(
                f"--dashboard-host {self.host} is beyond loopback: it needs --token-file and --tls-cert/"
                "--tls-key (a login over plain HTTP would send the token in the clear)"
            )


def _page(
    dashboard_port: int | None,
    dashboard_host: str,
    dashboard_allowed_hosts: tuple[str, ...],
    dashboard_max_connections: int,
    dashboard_max_streams: int,
) -> Page | None:
    limits = PageLimits(
        max_connections=dashboard_max_connections, max_streams=dashboard_max_streams, flags="--dashboard-"
    )
    if dashboard_port is None:
        return None
    return Page(dashboard_port, dashboard_host, dashboard_allowed_hosts, limits)


dashboard_options = option_group(
    "page",
    _page,
    click.option(
        "--dashboard-port",
        type=click.IntRange(min=0, max=65535),
        default=None,
        help="Serve this server's live web page on http://--dashboard-host:PORT/ (`tensorwire dashboard`).",
    ),
    click.option(
        "--dashboard-host",
        metavar="HOST",
        default="127.0.0.1",
        show_default=True,
        help="Bind the page here; beyond loopback it needs --token-file (a browser logs in with it) "
        "and --tls-cert (HTTPS only; with --tls-client-ca browsers need client certificates, as "
        "clients do).",
    ),
    click.option(
        "--dashboard-allowed-host",
        "dashboard_allowed_hosts",
        multiple=True,
        metavar="NAME",
        help="Also answer page requests for this Host name (repeatable; on loopback only localhost, "
        "127.0.0.1 and ::1 are answered otherwise: DNS rebinding).",
    ),
    click.option(
        "--dashboard-max-connections",
        type=click.IntRange(min=1),
        default=PageLimits.max_connections,
        show_default=True,
        help="The page's HTTP connections open at once (TLS handshakes included).",
    ),
    click.option(
        "--dashboard-max-streams",
        type=click.IntRange(min=1),
        default=PageLimits.max_streams,
        show_default=True,
        help="The page's live event streams (open pages) at once, all browsers together.",
    ),
)

relay_option = click.option(
    "--relay-networks",
    "relay_networks",
    metavar="CIDR",
    multiple=True,
    callback=_networks_param,
    help="Relay readers (Subscriber) may register a relay address in this network other than the IP "
    "their connection comes from: readers behind NAT, or relaying on another interface (repeatable; "
    "by default only that IP; loopback, link-local and unspecified addresses never).",
)


log_level_option = click.option(
    "--log-level", type=click.Choice(logs.LEVELS, case_sensitive=False), default=None,
    help="The same as `tensorwire --log-level` (kept for existing scripts).",
)  # fmt: skip


class _StoreCommand(click.Command):
    """``serve``: a parameter-server flag is pointed to ``ps serve``, where it now lives."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = [arg.split("=", 1)[0] for arg in args if arg.split("=", 1)[0] in PS_FLAGS]
        if given:
            raise click.UsageError(f"{given[0]} is a parameter-server option: use `tensorwire ps serve`", ctx)
        return super().parse_args(ctx, args)


@click.command(cls=_StoreCommand)
@listen_options
@server_options
@dashboard_options
@relay_option
@log_level_option
def serve(
    *, listen: Listen, options: ServerOptions, page: Page | None, relay_networks: tuple[str, ...],
    log_level: str | None,
) -> None:  # fmt: skip
    """Serve a tensor store, which is also a parameter server (with its defaults: `tensorwire ps
    serve` takes its options), until SIGINT or SIGTERM."""
    start(listen, options, PsOptions(), page=page, relay_networks=relay_networks, log_level=log_level)


def start(
    listen: Listen, options: ServerOptions, ps: PsOptions, *, page: Page | None = None,
    relay_networks: tuple[str, ...] = (), log_level: str | None = None,
) -> None:  # fmt: skip
    """Build the server ``options`` describe, with the parameter server ``ps``, the dataset digests
    and the relay coordinator, and serve until SIGINT or SIGTERM (``serve`` and ``ps serve``)."""
    from tensorwire.broadcast.coordinator import RelayCoordinator
    from tensorwire.dataset.digest import DigestService

    torch.set_num_threads(ps.torch_threads)
    if log_level is not None:
        logging.getLogger().setLevel(log_level.upper())
    if page is not None:
        page.check(options)
    server = Server(options, extensions=[param_server(ps, options.store.capacity)])
    server.extend(DigestService(server.store))
    RelayCoordinator.of(server, networks=relay_networks)  # readers of its generations relay them
    frozen = freeze_loaded()  # before the first peer: nothing of theirs is among them
    logging.getLogger("tensorwire.server").debug("%d objects loaded at start left out of collections", frozen)
    run(_serve(server, listen, page))


def _host_param(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(check_cert_host(v) for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


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


async def _start_page(server: Server, page: Page) -> Any:
    """The server's own dashboard page, reading its state in this process (tensorwire.dashboard),
    on a thread and event loop of its own: its HTTP and streams cost the serving loop nothing."""
    from tensorwire.dashboard import sources
    from tensorwire.dashboard.app import Dashboard
    from tensorwire.dashboard.listen import PageThread

    files = page.tls(server.options)
    tls = server_ssl_context(files) if files is not None else None
    urls = [[str(server.addresses[0])]] if server.addresses else [["local"]]
    dashboard = Dashboard(sources.local(server), urls, host=page.host, port=page.port, ssl_context=tls,
                          token=server.security.token, allowed_hosts=page.allowed_hosts,
                          limits=page.limits)  # fmt: skip
    thread = PageThread(dashboard)
    await asyncio.to_thread(thread.start)
    click.echo(f"tensorwire dashboard on {dashboard.url}")
    return thread


async def _serve(server: Server, listen: Listen, page: Page | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dashboard: Any = None
    try:
        addresses = await server.start(*listen.urls)
        for address in addresses:
            click.echo(f"tensorwire serving on {address}")  # click.echo flushes: a pipe reader sees it now
        if server.exporter is not None:
            click.echo(f"tensorwire metrics on {server.exporter.url}")
        dashboard = await _start_page(server, page) if page is not None else None
        if listen.ready_file is not None:
            _write_atomic(listen.ready_file, "".join(f"{a}\n" for a in addresses).encode())
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
