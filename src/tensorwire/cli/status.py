"""``tensorwire status URL...``: one screen about a cluster, from its servers' STATUS answers and
metrics; ``tensorwire probe URL``: is one server answering (a readiness probe).

The asking is ``tensorwire.dashboard.collect`` (re-exported here): every server in parallel, each
probe bounded, a server that is down shown as down with why. This module draws the screen.

A parameter server's jobs are listed below the servers, one row per job of each server (id, mode,
live workers of the world, step). Every string from a server is escaped before it reaches the
terminal (``tensorwire.cli.text``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from tensorwire.cli.options import client_security, client_timeout, connection_options, url_param
from tensorwire.cli.text import markup, printable
from tensorwire.client.options import ClientOptions
from tensorwire.dashboard.collect import (
    DEADLINE_FACTOR,
    DEFAULT_TIMEOUT,
    MAX_METRICS_BYTES,
    Node,
    _merge,
    answers,
    ask_status,
    check_metrics_url,
    collect,
    probe,
    scrape,
    split_urls,
    status_or_ping,
    summary,
)


@click.command("status")
@click.argument("servers", nargs=-1, required=True)
@click.option(
    "--metrics", "metrics_urls", metavar="URL", multiple=True,
    help="Also scrape this metrics endpoint (http://host:port/metrics), e.g. of a gRPC-only server.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print JSON: each server's STATUS, metrics summary.")
@connection_options(
    timeout=2.0,
    timeout_help="Seconds to wait for each server; one that does not answer in time is shown as down.",
)
def status_command(*, servers: tuple[str, ...], metrics_urls: tuple[str, ...], as_json: bool) -> None:
    """A one-screen summary of a cluster: which SERVERS are up, their role, shards, load and lag.

    SERVERS are URLs (HOST:PORT means tcp://); `a|b` names the replicas of one slot. Each is asked
    STATUS, and its metrics (serve --metrics-port) are scraped: only http(s) URLs, at most 16 MiB.
    Each server's whole probe ends within 3 x --timeout, however slowly it answers. Exits 1 if any
    server is down."""
    from rich.console import Console

    nodes = collect([*servers, *metrics_urls], client_timeout(), **client_security())
    if as_json:
        click.echo(json.dumps([n.to_dict() for n in nodes], indent=2, default=str))
    else:
        console = Console()
        Console(width=None if console.is_terminal else 160).print(render(nodes))
    if not all(n.up for n in nodes):
        raise SystemExit(1)


@click.command("probe")
@click.argument("url", callback=url_param)
@connection_options(
    timeout=2.0, timeout_help="Seconds the whole probe (connect, TLS, HELLO, STATUS) may take."
)
def probe_command(url: str) -> None:
    """Exit 0 when the server at URL answers STATUS within --timeout; else exit 1 with one line on
    stderr saying why (down, refused token or certificate, timeout).

    A readiness and liveness probe (the Helm chart's): `tensorwire probe tcp://localhost:7070
    --token-file /etc/tensorwire/auth/token`. A gRPC server (grpc://), which has no STATUS, is pinged."""
    timeout = client_timeout()
    options = ClientOptions(timeout=timeout, connect_timeout=timeout, **client_security())
    answer = answers(url, options)
    if answer is None:
        click.echo(f"{url} answered a ping (gRPC: no STATUS)")
        return
    role = summary(Node(url, status=answer))["role"]  # "primary @1", "" for a store
    click.echo(f"{url} answered STATUS" + (f": {printable(role, 40)}" if role else ""))


def render(nodes: Sequence[Node]) -> Any:
    """A rich table, one row per server, then one of the parameter servers' jobs; every string a
    server chose is escaped (``markup``)."""
    from rich.console import Group
    from rich.table import Table

    up = sum(n.up for n in nodes)
    table = Table(title=f"tensorwire cluster: {up} of {len(nodes)} servers up", title_justify="left")
    table.add_column("server", overflow="fold")
    table.add_column("host", overflow="fold")
    for column in ("state", "role", "shards", "step", "workers", "stored / capacity", "requests", "cpu, rss"):
        table.add_column(column, no_wrap=True)
    table.add_column("lag", overflow="fold")
    for node in nodes:
        if not node.up:
            table.add_row(markup(node.url), "", "[red]down[/red]", *[""] * 6, "", markup(node.error or ""))
            continue
        s = summary(node)
        state = "[green]up[/green]" + (" [yellow](no metrics)[/yellow]" if node.metrics_error else "")
        table.add_row(
            markup(node.url), markup(s["host"], 80), state, markup(s["role"], 80), _text(s["shards"]),
            _text(s["step"]), s["workers"] or "", f"{_bytes(s['stored'])} / {_bytes(s['capacity'])}",
            _requests(s), _cpu(s), markup(s["lag"] or ""),
        )  # fmt: skip
    jobs = _jobs_table([n for n in nodes if n.up])
    return table if jobs is None else Group(table, jobs)


def _jobs_table(nodes: Sequence[Node]) -> Any:
    """The parameter servers' jobs, one row each (None when no server lists one)."""
    from rich.table import Table

    rows = [(node.url, job) for node in nodes for job in summary(node)["jobs"]]
    if not rows:
        return None
    table = Table(title="jobs", title_justify="left")
    table.add_column("server", overflow="fold")
    table.add_column("job", overflow="fold")
    for column in ("mode", "workers", "step"):
        table.add_column(column, no_wrap=True)
    for url, job in rows:
        workers = f"{_text(job['live'])}/{_text(job['world'])}"
        table.add_row(markup(url), markup(job["job"], 80), markup(job["mode"] or "", 40), workers,
                      _text(job["step"]))  # fmt: skip
    return table


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _requests(s: dict[str, Any]) -> str:
    if s["requests"] is None:
        return ""
    busy = f", {s['in_flight']} now" if s["in_flight"] else ""
    return f"{s['requests']}{busy} ({s['connections']} conn)"


def _cpu(s: dict[str, Any]) -> str:
    cpu = f"{s['cpu_s']:.1f}s" if s["cpu_s"] is not None else "?"
    return f"{cpu}, {_bytes(s['rss'])}" if s["rss"] is not None else ("" if s["cpu_s"] is None else cpu)


__all__ = [
    "DEADLINE_FACTOR", "DEFAULT_TIMEOUT", "MAX_METRICS_BYTES", "Node", "_merge", "answers", "ask_status",
    "check_metrics_url", "collect", "probe", "render", "scrape", "split_urls", "status_or_ping", "summary",
]  # fmt: skip
