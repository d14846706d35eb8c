"""``tensorwire dashboard URL...``: a live web page of a cluster (``tensorwire.dashboard``).

The page is built from what ``tensorwire status`` reads (each server's STATUS and metrics),
collected about once a second. It binds 127.0.0.1 by default and there answers only requests
whose Host names this machine (``--allowed-host`` adds names: a proxy's, say). ``--host`` beyond
loopback needs the servers' token (a browser logs in with it; it is never sent to the browser) and
a certificate (``--tls-cert``/``--tls-key``: the page is HTTPS only there), and with
``--tls-client-ca`` asks browsers for client certificates, as the servers do.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import click

from tensorwire._aio import run
from tensorwire.cli.options import FILE
from tensorwire.dashboard.guard import Limits
from tensorwire.security import TlsFiles, client_token, is_loopback, load_token, server_ssl_context

if TYPE_CHECKING:  # the app needs the `dashboard` extra (aiohttp): imported when the command runs
    from tensorwire.dashboard.app import Dashboard


@click.command("dashboard")
@click.argument("servers", nargs=-1, required=True)
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8265, show_default=True,
              help="Serve the page on this port (0: a free one; the URL is printed).")  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Bind here; beyond loopback the page asks for the servers' token.")  # fmt: skip
@click.option("--timeout", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds to wait for each server; one that does not answer is shown as down.")  # fmt: skip
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between snapshots.")  # fmt: skip
@click.option("--tls-ca", type=FILE, help="CA of the servers' certificates (tls://).")
@click.option("--token-file", type=FILE, help="The servers' shared token (default: $TENSORWIRE_TOKEN).")
@click.option("--tls-cert", type=FILE, help="Serve the page over HTTPS with this certificate (PEM).")
@click.option("--tls-key", type=FILE, help="Its private key (PEM).")
@click.option("--tls-client-ca", type=FILE,
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
def dashboard(
    *, servers: tuple[str, ...], port: int, host: str, timeout: float, interval: float,
    tls_ca: Path | None, token_file: Path | None, tls_cert: Path | None, tls_key: Path | None,
    tls_client_ca: Path | None, allowed_hosts: tuple[str, ...], max_connections: int,
    connections_per_client: int, max_streams: int,
) -> None:  # fmt: skip
    """A live web page of the cluster of SERVERS: slots and failovers, stores, traffic, jobs.

    SERVERS are URLs as for `tensorwire status` (HOST:PORT means tcp://; `a|b` is one slot's
    replicas). Runs until SIGINT or SIGTERM."""
    from tensorwire.dashboard import sources
    from tensorwire.dashboard.app import Dashboard
    from tensorwire.dashboard.view import slots_of

    token = load_token(token_file) if token_file else client_token(None)
    if not is_loopback(host) and not token:
        raise click.UsageError(f"--host {host} is beyond loopback: give --token-file (the servers' token)")
    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    if not is_loopback(host) and not tls_cert:
        raise click.UsageError(
            f"--host {host} is beyond loopback: give --tls-cert and --tls-key (the login would send the "
            "token in the clear over plain HTTP)"
        )
    if tls_client_ca and not tls_cert:
        raise click.UsageError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = server_ssl_context(TlsFiles(tls_cert, tls_key, tls_client_ca)) if tls_cert else None
    source = sources.network(servers, timeout, tls=TlsFiles(ca=tls_ca) if tls_ca else None, token=token)
    limits = Limits(max_connections=max_connections, connections_per_client=connections_per_client,
                    max_streams=max_streams)  # fmt: skip
    page = Dashboard(source, slots_of(servers), host=host, port=port, token=token, ssl_context=tls,
                     interval=interval, allowed_hosts=allowed_hosts, limits=limits)  # fmt: skip
    run(_serve(page))


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
