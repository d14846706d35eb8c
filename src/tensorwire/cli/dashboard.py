"""``tensorwire dashboard URL...``: a live web page of a cluster (``tensorwire.dashboard``).

The page is built from what ``tensorwire status`` reads (each server's STATUS and metrics),
collected about once a second; it reaches the servers as every command does (--tls-ca, --tls-cert,
--tls-key, --token, --token-file, --timeout). It binds 127.0.0.1 by default and there answers only
requests whose Host names this machine (``--allowed-host`` adds names: a proxy's, say). ``--host``
beyond loopback needs the servers' token (a browser logs in with it; it is never sent to the
browser) and the page's own certificate (``--page-tls-cert``/``--page-tls-key``: the page is HTTPS
only there), and with ``--page-tls-client-ca`` asks browsers for client certificates, as the
servers do.

Until 0.3.0, ``--tls-cert``/``--tls-key`` without ``--page-tls-cert``/``--page-tls-key`` still
name the page's certificate, as they did in 0.1 (with a warning), and ``--tls-client-ca`` is
``--page-tls-client-ca``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tensorwire._aio import run
from tensorwire.cli.options import (
    FILE,
    client_security,
    client_timeout,
    connection_options,
    given_security,
    renamed_option,
    warn_deprecated,
)
from tensorwire.dashboard.guard import Limits
from tensorwire.security import TlsFiles, client_token, is_loopback, server_ssl_context

if TYPE_CHECKING:  # the app needs the `dashboard` extra (aiohttp): imported when the command runs
    from tensorwire.dashboard.app import Dashboard

# What the deprecated page spelling of --tls-cert/--tls-key turns into in 0.3.0.
_CLIENT_CERT_FROM_0_3 = (
    "from 0.3.0 --tls-cert/--tls-key on dashboard are the client certificate, as on every command"
)


@click.command("dashboard")
@click.argument("servers", nargs=-1, required=True)
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8265, show_default=True,
              help="Serve the page on this port (0: a free one; the URL is printed).")  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Bind here; beyond loopback the page asks for the servers' token.")  # fmt: skip
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between snapshots.")  # fmt: skip
@click.option("--page-tls-cert", type=FILE, help="Serve the page over HTTPS with this certificate (PEM).")
@click.option("--page-tls-key", type=FILE, help="The private key of --page-tls-cert (PEM).")
@renamed_option("--page-tls-client-ca", "--tls-client-ca", "page_tls_client_ca", type=FILE,
                help="Ask browsers for a client certificate this CA signed (as servers do).")  # fmt: skip
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              help="Also answer requests for this Host name (repeatable): a proxy's, or this machine's DNS "
              "name. On loopback only localhost, 127.0.0.1 and ::1 are answered otherwise.")  # fmt: skip
@click.option("--max-connections", type=click.IntRange(min=1), default=Limits.max_connections,
              show_default=True, help="HTTP connections open at once (TLS handshakes included); more are "
              "closed at once.")  # fmt: skip
@click.option("--connections-per-client", type=click.IntRange(min=1), default=Limits.connections_per_client,
              show_default=True, help="HTTP connections one client address (IPv6: a /64) may hold "
              "open.")  # fmt: skip
@click.option("--max-streams", type=click.IntRange(min=1), default=Limits.max_streams, show_default=True,
              help="Live event streams (open pages) at once, all browsers together.")  # fmt: skip
@connection_options(
    timeout=1.0, timeout_help="Seconds to wait for each server; one that does not answer is shown as down."
)
def dashboard(
    *, servers: tuple[str, ...], port: int, host: str, interval: float, page_tls_cert: Path | None,
    page_tls_key: Path | None, page_tls_client_ca: Path | None, allowed_hosts: tuple[str, ...],
    max_connections: int, connections_per_client: int, max_streams: int,
) -> None:  # fmt: skip
    """A live web page of the cluster of SERVERS: slots and failovers, stores, traffic, jobs.

    SERVERS are URLs as for `tensorwire status` (HOST:PORT means tcp://; `a|b` is one slot's
    replicas), reached as by every command (--tls-ca, --tls-cert, --tls-key: this client's
    certificate for servers that ask for one, --token, --token-file, --timeout). The page's own
    HTTPS listener takes --page-tls-cert, --page-tls-key, --page-tls-client-ca (until 0.3.0,
    --tls-cert/--tls-key without them still name the page's certificate, with a warning). Runs
    until SIGINT or SIGTERM."""
    from tensorwire.dashboard import sources
    from tensorwire.dashboard.app import Dashboard
    from tensorwire.dashboard.view import slots_of

    page_tls, given = split_page_tls(given_security(), page_tls_cert, page_tls_key, page_tls_client_ca)
    security = client_security(given)
    token = client_token(security.get("token"))
    check_exposure(host, token, page_tls)
    tls = server_ssl_context(page_tls) if page_tls else None
    source = sources.network(servers, client_timeout(), **security)
    limits = Limits(max_connections=max_connections, connections_per_client=connections_per_client,
                    max_streams=max_streams)  # fmt: skip
    page = Dashboard(source, slots_of(servers), host=host, port=port, token=token, ssl_context=tls,
                     interval=interval, allowed_hosts=allowed_hosts, limits=limits)  # fmt: skip
    run(_serve(page))


def split_page_tls(
    given: Mapping[str, str], cert: Path | None, key: Path | None, client_ca: Path | None
) -> tuple[TlsFiles | None, dict[str, str]]:
    """(the page's own TLS files, None for plain HTTP; the client options ``given`` that remain the
    client's), from --page-tls-cert/--page-tls-key/--page-tls-client-ca and the client's options.

    Without --page-tls-cert/--page-tls-key, a --tls-cert/--tls-key is still the page's
    certificate, as in 0.1, with a warning; with either, --tls-cert/--tls-key are this client's
    certificate, as on every command (and only that, from 0.3.0)."""
    client = dict(given)
    if cert is None and key is None and ("tls_cert" in client or "tls_key" in client):
        warn_deprecated("--tls-cert/--tls-key for the page's certificate", "--page-tls-cert/--page-tls-key",
                        note=_CLIENT_CERT_FROM_0_3)  # fmt: skip
        cert, key = _path(client.pop("tls_cert", None)), _path(client.pop("tls_key", None))
    if (cert is None) != (key is None):
        raise click.UsageError("--page-tls-cert and --page-tls-key go together")
    if client_ca is not None and cert is None:
        raise click.UsageError("--page-tls-client-ca needs --page-tls-cert and --page-tls-key")
    return (TlsFiles(cert, key, client_ca) if cert is not None else None), client


def check_exposure(host: str, token: str | None, page_tls: TlsFiles | None) -> None:
    """A usage error unless a page bound to ``host`` is private: on loopback, or behind the servers'
    token and HTTPS (a login over plain HTTP would send the token in the clear)."""
    if is_loopback(host):
        return
    if not token:
        raise click.UsageError(f"--host {host} is beyond loopback: give --token-file (the servers' token)")
    if page_tls is None:
        raise click.UsageError(
            f"--host {host} is beyond loopback: give --page-tls-cert and --page-tls-key (the login would "
            "send the token in the clear over plain HTTP)"
        )


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


async def _serve(page: Dashboard) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await page.start()
    click.echo(f"tensorwire dashboard on {page.url}")
    try:
        await stop.wait()
    finally:
        await page.close()
