"""``tensorwire ps serve | launch | stats | end | plan``: the parameter server.

The parameter server's modules are heavy and only these commands need them: each command imports
what it runs when it runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import torch

from tensorwire.cli.options import (
    FILE,
    CliError,
    client_security,
    client_timeout,
    connection_options,
    parse_size,
    renamed_option,
    url_param,
)
from tensorwire.cli.ps_options import PsOptions, ps_options
from tensorwire.cli.serve import Page, dashboard_options, log_level_option, relay_option, start
from tensorwire.cli.server_options import Listen, check_secrets, listen_options, server_options
from tensorwire.client.core import ClientOptions
from tensorwire.server.options import ServerOptions

if TYPE_CHECKING:
    from tensorwire.ps.layout import Layout


@click.group()
def ps() -> None:
    """The parameter server."""


@ps.command("serve")
@listen_options
@server_options
@ps_options
@dashboard_options
@relay_option
@log_level_option
def ps_serve(
    *, listen: Listen, options: ServerOptions, parameter_server: PsOptions, page: Page | None,
    relay_networks: tuple[str, ...], log_level: str | None,
) -> None:  # fmt: skip
    """Serve a tensor store, which is also a parameter server, until SIGINT or SIGTERM: one process
    of a cluster (`tensorwire serve` with the parameter server's options)."""
    check_secrets([("--token-file", options.token), ("--peer-token-file", parameter_server.peer.token),
                   ("--operator-token-file", parameter_server.operator_token),
                   ("--metrics-token-file", options.metrics.token)])  # fmt: skip
    start(listen, options, parameter_server, page=page, relay_networks=relay_networks, log_level=log_level)


@ps.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--servers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--replicas", type=click.IntRange(min=0), default=0, show_default=True,
    help="Standby backups per server (each takes over when its primary dies).",
)  # fmt: skip
@renamed_option(
    "--deadline", "--timeout", "deadline", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
    help="Stop everything after this many seconds in all (as dataset --deadline).",
)  # fmt: skip
@click.argument("script", nargs=-1, required=True, type=click.UNPROCESSED)
def ps_launch(
    servers: int, workers: int, replicas: int, deadline: float | None, script: tuple[str, ...]
) -> None:
    """Start SERVERS parameter servers and WORKERS copies of `python SCRIPT ARGS...` on this machine.

    Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, TENSORWIRE_SERVERS and the
    run's TENSORWIRE_JOB_TOKEN (a fresh one, unless set here: the job is its workers'), which
    `tensorwire.ps.Worker` reads. Exits with the first failing worker's code."""
    from tensorwire.ps import launch

    raise SystemExit(launch.run(script, servers, workers, deadline, replicas))


def _job_param(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from tensorwire.wire.ps import check_job_id

    try:
        return None if value is None else check_job_id(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


# ps stats and ps end wait 10 s for each server by default (as tensorwire.ps.worker.rpc does).
_connection_options = connection_options(timeout=10.0)


@ps.command("stats")
@click.argument("servers", nargs=-1, required=True, callback=url_param)
@click.option("--job", metavar="JOB", callback=_job_param, help="That job's view (default: the server's).")
@click.option("--jobs", "as_table", is_flag=True, help="One line per job of each server, not JSON.")
@_connection_options
def ps_stats(servers: tuple[str, ...], job: str | None, as_table: bool) -> None:
    """Print each parameter server's view (JSON): role, capacity, its jobs (id, mode, world, live
    workers, step), the jobs that ended, and a job's mode, step, workers, staleness (--job JOB,
    or the server's only job)."""
    from tensorwire.ps.worker.rpc import server_stats

    security = ClientOptions(**client_security()).security()
    docs = server_stats(list(servers), timeout=client_timeout(), security=security, job=job)
    if not as_table:
        click.echo(json.dumps(docs, indent=2))
        return
    click.echo(f"{'server':32} {'job':40} {'mode':8} {'world':>5} {'live':>5} {'step':>8}")
    for url, doc in zip(servers, docs, strict=True):
        for job_id, summary in sorted(doc.get("jobs", {}).items()):
            click.echo(f"{url:32} {job_id:40} {summary.get('mode') or '-':8} {summary.get('world', 0):>5} "
                       f"{summary.get('live', 0):>5} {summary.get('step', 0):>8}")  # fmt: skip


@ps.command("end")
@click.argument("job", callback=_job_param)
@click.argument("servers", nargs=-1, required=True, callback=url_param)
@click.option("--force", is_flag=True, help="End it even while workers are live (they then get an error).")
@click.option(
    "--job-token-file", type=FILE,
    help="A file holding the job's token, which its workers share (default: $TENSORWIRE_JOB_TOKEN).",
)  # fmt: skip
@click.option(
    "--operator-token-file", type=FILE,
    help="A file holding the servers' operator token (ps serve --operator-token-file): it ends any job.",
)  # fmt: skip
@_connection_options
def ps_end(
    job: str,
    servers: tuple[str, ...],
    force: bool,
    job_token_file: Path | None,
    operator_token_file: Path | None,
) -> None:
    """End JOB on each of SERVERS: its state freed, its last checkpoint written (with
    --checkpoint-dir). Refused while it has live workers, unless --force. A job its workers started
    with a job token ends only for a client that offers it (--job-token-file, $TENSORWIRE_JOB_TOKEN)
    or the servers' operator token (--operator-token-file); one started without, for any client the
    servers admit (with --token-file, one that offers the token)."""
    from tensorwire.ps.worker.rpc import end_job
    from tensorwire.security import load_token

    if job_token_file is not None and operator_token_file is not None:
        raise click.UsageError("give --job-token-file or --operator-token-file, not both")
    given = job_token_file or operator_token_file
    security = ClientOptions(**client_security()).security()
    credential = load_token(given) if given is not None else None
    end_job(
        list(servers), job, force=force, timeout=client_timeout(), security=security, credential=credential
    )
    click.echo(f"ended job {job} on {len(servers)} server(s)")


@ps.command("plan")
@click.argument("model", type=FILE)
@click.option("--servers", type=click.IntRange(min=1), required=True, help="How many servers.")
@click.option("--split-bytes", metavar="SIZE", default=None, help="Split tensors above this size.")
@click.option(
    "--replicas", type=click.IntRange(min=0), default=None,
    help="Backups per server: also show which host runs each slot's primary and backups.",
)  # fmt: skip
@click.option(
    "--hosts", metavar="H1,H2,...", default=None,
    help="The hosts servers may run on (with --replicas) [default: this host, $TENSORWIRE_HOST].",
)  # fmt: skip
@click.option("--racks", metavar="R1,R2,...", default=None, help="Each --hosts entry's rack, in order.")
@click.option("--json", "as_json", is_flag=True, help="Print the placement as JSON.")
def ps_plan(
    model: Path,
    *,
    servers: int,
    split_bytes: str | None,
    replicas: int | None,
    hosts: str | None,
    racks: str | None,
    as_json: bool,
) -> None:
    """Show which bytes of MODEL (.safetensors, or .pt/.pth state dict) live on which server; with
    --replicas (or --hosts), which host serves each slot's primary and backups, and a warning where
    the hosts cannot keep a slot's replicas apart."""
    from tensorwire.ps import plan

    bound = parse_size(split_bytes) if split_bytes is not None else None
    placement = plan(_param_specs(model), servers, bound)
    if replicas is None and hosts is None:
        click.echo(placement.to_json() if as_json else placement.describe())
        return
    layout = _layout(servers, replicas or 0, hosts, racks)
    if as_json:
        click.echo(json.dumps({**json.loads(placement.to_json()), "hosts": layout.as_dict()}, indent=2))
    else:
        click.echo(placement.describe() + "\n\n" + layout.describe())


def _layout(servers: int, replicas: int, hosts: str | None, racks: str | None) -> Layout:
    """Which host serves each slot's replicas (``ps/layout.py``), from --hosts/--racks."""
    from tensorwire import topology
    from tensorwire.ps.layout import assign, parse_hosts

    try:
        if hosts is None:
            if racks is not None:
                raise ValueError("--racks needs --hosts")
            candidates = [topology.here()]
        else:
            candidates = parse_hosts(hosts, racks)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    return assign(candidates, servers, replicas)


def _param_specs(path: Path) -> list[Any]:
    """Names, shapes and dtypes of a saved state dict; a safetensors file is read header only."""
    from tensorwire.ps import ParamSpec

    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 - not a dict
            return [
                ParamSpec(name, tuple(s.get_shape()), _SAFETENSORS_DTYPES[s.get_dtype()])
                for name, s in slices.items()
            ]
    state = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(state, Mapping) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CliError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    return ParamSpec.from_tensors(state)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
