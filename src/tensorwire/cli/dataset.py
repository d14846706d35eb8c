"""``tensorwire dataset scatter | fetch``: the command-line face of ``tensorwire.dataset``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from tensorwire._aio import Deadline
from tensorwire.cli.options import (
    EACH_WAIT,
    CliError,
    client_options,
    connection_options,
    size_param,
    url_param,
)
from tensorwire.cli.text import printable
from tensorwire.client.core import ClientOptions
from tensorwire.dataset.fetch import fetch as fetch_shards
from tensorwire.dataset.scatter import Advance, NodeReport, ScatterReport, check_node
from tensorwire.dataset.scatter import scatter as scatter_shards

DEFAULT_DEADLINE = 3600.0  # seconds a whole scatter or fetch may take (--deadline)


# --timeout is each network wait; --deadline (above) the whole command.
_connection_options = connection_options(timeout_help=f"{EACH_WAIT} --deadline bounds the whole command.")


def _parse_nodes(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    urls = [part.strip() for v in value for part in v.split(",") if part.strip()]
    if not urls:
        raise click.BadParameter("name at least one node", ctx, param)
    try:
        return [check_node(url) for url in url_param(ctx, param, tuple(urls))]
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _parse_source(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if "://" in value or not Path(value).exists():  # HOST:PORT or a URL; else a data dir
        return str(url_param(ctx, param, value))
    return value


def _parse_rate(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    return None if value is None else int(size_param(ctx, param, value))


def _deadline_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--deadline", type=click.FloatRange(min=1), default=DEFAULT_DEADLINE, show_default=True,
        metavar="SECONDS", help=f"Give up {what} after this many seconds in all, however slowly "
        "the servers answer (--timeout bounds each wait; a re-run goes on from what is already there).",
    )  # fmt: skip


@click.group("dataset")
def dataset() -> None:
    """Ship shards of a data set to the nodes that train on them, and read them there."""


@dataset.command("scatter")
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--to",
    "nodes",
    multiple=True,
    required=True,
    callback=_parse_nodes,
    metavar="URL,URL,...",
    help="The nodes' servers (`tensorwire serve --data-dir DIR` on each); comma-separated or repeated.",
)
@click.option(
    "--shards",
    type=click.IntRange(min=1),
    default=None,
    help="How many shards [default: one per node]; shard k goes to node k mod nodes.",
)
@click.option(
    "--by",
    type=click.Choice(["files", "rows"]),
    default="files",
    show_default=True,
    help="files: whole files to shards; rows: tensors (.safetensors/.npy) split along dim 0.",
)
@click.option("--name", "name", default=None, help="The data set's name on the nodes [default: SRC's name].")
@click.option(
    "--block-size",
    default="64MiB",
    show_default=True,
    callback=size_param,
    help="--by rows: the largest item sent (rows of one tensor); also what a resume redoes.",
)
@click.option(
    "--max-rate",
    default=None,
    callback=_parse_rate,
    metavar="SIZE",
    help="Cap each node's sending at SIZE bytes per second (e.g. 100MiB).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as JSON (sent and skipped per node)."
)
@click.option(
    "--replace", is_flag=True,
    help="Overwrite a data set of this name that the nodes hold from another tree (or with other "
    "--shards/--by/--block-size, or an edited SRC, or scattered from another host or path), pruning "
    "what SRC does not have. Without it, such a scatter is refused before anything is sent; a "
    "re-run of the same SRC needs no flag.",
)  # fmt: skip
@_deadline_option("the scatter")
@_connection_options
def scatter(
    *, src: Path, nodes: list[str], shards: int | None, by: str, name: str | None, block_size: int,
    max_rate: int | None, as_json: bool, replace: bool, deadline: float,
) -> None:  # fmt: skip
    """Split SRC into shards and send each to a node, verified; a re-run sends only what is missing.

    The nodes remember which tree a data set's name holds: scattering another tree (or the same
    one with other options, or edited) under a name in use is refused unless --replace."""
    options = ClientOptions(**client_options())
    until = Deadline.after(deadline, f"dataset scatter (--deadline {deadline:g}s)")
    with _bars(len(nodes)) as (advance, on_plan):
        report = scatter_shards(src, nodes, shards=shards, by=by,  # type: ignore[arg-type]
                                dataset=name, block_bytes=block_size, max_rate=max_rate,
                                options=options, advance=advance, on_plan=on_plan,
                                deadline=until, replace=replace)  # fmt: skip
    _print_report(report, as_json)
    failed = [node for node in report.nodes if node.error]
    if failed:
        raise CliError("; ".join(f"{node.url}: {node.error}" for node in failed))


@dataset.command("fetch")
@click.argument("source", metavar="URL|DATA_DIR", callback=_parse_source)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True)
@click.option("--name", "name", default=None, help="Which data set [default: the only one there].")
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--prefer-local/--no-prefer-local", default=True, show_default=True,
    help="Read a server on this host through its shm:// listener, if it serves one.",
)  # fmt: skip
@click.option(
    "--replace", is_flag=True,
    help="Overwrite files under --out whose bytes differ from the data set's. Without it, such a "
    "fetch is refused before anything is written.",
)  # fmt: skip
@_deadline_option("the fetch")
@_connection_options
def fetch(
    *, source: str, out: Path, name: str | None, as_json: bool, prefer_local: bool, replace: bool,
    deadline: float,
) -> None:  # fmt: skip
    """Write the shards a node holds (from its server, or its data dir) back to files under --out.

    Paths come from the node's manifests: each must be a plain relative path, and nothing is
    written outside --out or through a link found under it. A file there with other bytes is
    not overwritten unless --replace."""
    until = Deadline.after(deadline, f"dataset fetch (--deadline {deadline:g}s)")
    options = ClientOptions(**client_options(), deadline=until, prefer_local=prefer_local)
    report = fetch_shards(source, out, name, options, deadline=until, replace=replace)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
    else:
        done = f"{len(report.written)} written ({len(report.replaced)} over other bytes), "
        done += f"{len(report.unchanged)} already there"
        click.echo(f"{printable(report.dataset, 200)}: shards {report.shards} ({report.by}), "
                   f"{report.bytes} B: {done} -> {out}")  # fmt: skip


@contextmanager
def _bars(nodes: int) -> Iterator[tuple[Advance, Any]]:
    """One rich bar per node on stderr (only on a terminal); yields (advance, on_plan) callbacks."""
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
               TransferSpeedColumn())  # fmt: skip
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        tasks: list[Any] = []

        def on_plan(plan: Any, reports: list[NodeReport]) -> None:
            for node in reports:
                tasks.append(
                    bar.add_task(printable(f"{node.url} shards {node.shards}", 200), total=node.bytes)
                )

        def advance(i: int, n: int) -> None:  # from the nodes' threads; Progress takes its own lock
            if tasks:
                bar.advance(tasks[i], n)

        yield advance, on_plan


def _print_report(report: ScatterReport, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        return
    for node in report.nodes:
        state = "verified" if node.verified else f"FAILED ({printable(node.error)})"
        click.echo(f"{node.url}  shards {node.shards}  sent {node.sent_items} items / {node.sent_bytes} B, "
                   f"already there {node.skipped_items} / {node.skipped_bytes} B, "
                   f"pruned {node.pruned}, {node.seconds:.2f}s  {state}")  # fmt: skip
        if node.replaced:  # said loudly: --replace overwrote another tree here
            click.echo(f"  replaced {printable(node.replaced)}", err=True)
        if node.tidy:
            click.echo(f"  {printable(node.tidy)}", err=True)
