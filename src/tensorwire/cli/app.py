"""The ``tensorwire`` command: run a server, move tensors between files and a server, run the demo.

::

    tensorwire serve --listen 0.0.0.0:7070 --capacity 16GiB --data-dir /var/lib/tensorwire
    tensorwire put model/w weights.safetensors --key layer0.weight
    tensorwire get model/w -o w.npy
    tensorwire ls model/ --json

Every command that talks to a server takes ``--server`` (or ``TENSORWIRE_SERVER``). Every error a
command meets ends it with one ``error: <message>`` line on stderr and exit status 1, never a
traceback (``--log-level debug`` logs the traceback of an unexpected one). Strings a server chose
(tensor names, error messages, status fields) are escaped before they reach the terminal
(``tensorwire.cli.text``), and files are written without following links planted where they go
(``tensorwire._fs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from tensorwire import __version__, logs
from tensorwire import transport as transports
from tensorwire._aio import run
from tensorwire._fs import write_file
from tensorwire.bench import BENCHMARKS
from tensorwire.cli.text import markup, printable
from tensorwire.client.core import Client, ClientOptions, connect
from tensorwire.errors import TensorwireError
from tensorwire.security import (
    DEV_CERT_HOSTS,
    TOKEN_ENV,
    Security,
    TlsFiles,
    check_cert_host,
    load_token,
    write_dev_certs,
)
from tensorwire.server.core import Server
from tensorwire.store import TensorStore
from tensorwire.store.memory import DEFAULT_MAX_TENSORS
from tensorwire.store.uploads import DEFAULT_MAX_UPLOADS, DEFAULT_UPLOADS_PER_CLIENT
from tensorwire.types import Address, GiB, KiB, MiB, TensorMeta
from tensorwire.wire.dtypes import dtype_name

DEFAULT_URL = "tcp://127.0.0.1:7070"
SERVER_ENV = "TENSORWIRE_SERVER"
PROGRESS_MIN_BYTES = 64 * MiB  # below this a transfer is over before a bar would be worth drawing
FORMATS = (".safetensors", ".npy", ".pt", ".pth")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": 10**3,
    "m": MiB, "mib": MiB, "mb": 10**6,
    "g": GiB, "gib": GiB, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")

# torch dtypes numpy has an exact counterpart for; others (bfloat16, float8, ...) cannot go to .npy.
_NUMPY_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})  # fmt: skip


class CliError(click.ClickException):
    """A failure the user can act on: printed as ``error: <message>`` in red, exit status 1."""

    def show(self, file: Any = None) -> None:
        # The message may quote a server (an ERROR frame's text): one line, no escape sequences.
        click.secho(f"error: {printable(self.format_message())}", fg="red", err=True)


# -- parameter types -------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"8GiB"`` -> 8589934592; also ``"512MiB"``, ``"1.5GB"``, ``"4k"``, plain bytes."""
    match = _SIZE_RE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {text!r}: expected e.g. 8GiB, 512MiB, 1.5GB or a number of bytes")
    try:  # Decimal, not float: a large plain byte count must come back exact
        return int(Decimal(match.group(1)) * _SIZE_UNITS[unit])
    except InvalidOperation as exc:
        raise ValueError(f"invalid size {text!r}") from exc


def parse_url(text: str) -> str:
    """``"HOST:PORT"`` means ``tcp://HOST:PORT``; returns the normalised URL or raises ValueError."""
    address = Address.parse(text if "://" in text else f"tcp://{text}")
    transports.check_scheme(address)  # refuse an unknown scheme here rather than at connect time
    return str(address)


def _grpc_param(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """``HOST:PORT`` (or ``grpc://HOST:PORT``) for --grpc-listen."""
    try:
        return tuple(parse_url(v if "://" in v else f"grpc://{v}") for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


def _size_param(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc
    if size <= 0:
        raise click.BadParameter(f"size must be positive, not {value!r}", ctx, param)
    return size


def _url_param(ctx: click.Context, param: click.Parameter, value: str | tuple[str, ...]) -> Any:
    try:
        return parse_url(value) if isinstance(value, str) else tuple(parse_url(v) for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


_CLIENT_META = "tensorwire.client_options"
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def _client_param(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Collect --tls-ca/--tls-cert/--tls-key/--token for ``_connect`` (they are not arguments)."""
    if value is not None and param.name is not None:
        ctx.meta.setdefault(_CLIENT_META, {})[param.name] = value


def server_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """--server and the options that say how to reach it securely."""
    command = security_options(command)
    return click.option(
        "--server", metavar="URL", callback=_url_param, envvar=SERVER_ENV, default=DEFAULT_URL,
        show_default=True, help=f"Server address (env {SERVER_ENV}): tcp://, tls://, grpc://, grpcs://.",
    )(command)  # fmt: skip


def security_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--tls-ca, --tls-cert, --tls-key, --token: how to reach servers securely (see ``client_options``)."""
    file = click.Path(exists=True, dir_okay=False)
    options = [
        click.option("--tls-ca", type=file, callback=_client_param, expose_value=False,
                     help="CA that signs the server's certificate (tls://, grpcs://)."),
        click.option("--tls-cert", type=file, callback=_client_param, expose_value=False,
                     help="This client's certificate, for servers that require one (mTLS)."),
        click.option("--tls-key", type=file, callback=_client_param, expose_value=False,
                     help="The private key of --tls-cert."),
        click.option("--token", metavar="TOKEN", callback=_client_param, expose_value=False,
                     help=f"The server's shared token (default: ${TOKEN_ENV})."),
    ]  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


def client_options() -> dict[str, Any]:
    """This command's ``security_options``, as keyword arguments of ``connect``/``ClientOptions``."""
    return dict(click.get_current_context().meta.get(_CLIENT_META, {}))


def _connect(server: str) -> Client:
    """A client of ``server`` with this command's security options."""
    return connect(server, **client_options())


# -- the group -------------------------------------------------------------------------------------
class _Group(click.Group):
    """Turns every error a command can meet into one red line: server refusals, the network,
    files, and anything unexpected (named by its type; its traceback is logged at debug level)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (TensorwireError, OSError) as exc:
            raise CliError(str(exc) or type(exc).__name__) from exc
        except Exception as exc:
            logging.getLogger("tensorwire.cli").debug("the command failed", exc_info=True)
            raise CliError(f"{exc} ({type(exc).__name__})" if str(exc) else type(exc).__name__) from exc


@click.group("tensorwire", cls=_Group)
@click.version_option(__version__, prog_name="tensorwire")
@click.option(
    "--log-level", type=click.Choice(logs.LEVELS, case_sensitive=False), default="warning",
    envvar=logs.LEVEL_ENV, show_default=True, help=f"Log events at this level and up (env {logs.LEVEL_ENV}).",
)  # fmt: skip
@click.option(
    "--log-format", type=click.Choice(logs.FORMATS), default="text", envvar=logs.FORMAT_ENV,
    show_default=True, help=f"One line per event: key=value text, or JSON (env {logs.FORMAT_ENV}).",
)  # fmt: skip
def main(log_level: str, log_format: str) -> None:
    """Move and keep PyTorch tensors across processes and machines."""
    logs.configure(log_level.lower(), log_format)


# -- serve -----------------------------------------------------------------------------------------
@main.command()
@click.option(
    "--listen", "listen", metavar="URL", callback=_url_param, multiple=True,
    default=[DEFAULT_URL], show_default=True,
    help="Address to serve on (repeatable); HOST:PORT means tcp://HOST:PORT, port 0 picks a free one.",
)  # fmt: skip
@click.option(
    "--grpc-listen", "grpc_listen", metavar="HOST:PORT", callback=_grpc_param, multiple=True,
    help="Also serve the gRPC TensorService here (repeatable), on the same store.",
)  # fmt: skip
@click.option(
    "--capacity", metavar="SIZE", callback=_size_param, default="8GiB", show_default=True,
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
    "--resumable-min-bytes", metavar="SIZE", callback=_size_param, default="16MiB", show_default=True,
    help="Smaller resumable puts keep no upload state (served as plain puts).",
)  # fmt: skip
@click.option("--tls-cert", type=_FILE, help="Server certificate (PEM) for tls:// and grpcs:// addresses.")
@click.option("--tls-key", type=_FILE, help="Its private key (PEM).")
@click.option("--tls-client-ca", type=_FILE, help="Require client certificates signed by this CA (mTLS).")
@click.option("--token-file", type=_FILE, help="Require this shared token from every client.")
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
    "--backup", "backups", metavar="URL", multiple=True, callback=_url_param,
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
    "--peer-token-file", type=_FILE,
    help="Parameter server: the secret the replicas of one slot share (not the clients' token); "
    "required with --backup/--standby. Only a connection that offers it may replicate.",
)  # fmt: skip
@click.option(
    "--peer-tls-ca", type=_FILE, help="Parameter server: CA of the tls:// --backup servers' certificates."
)
@click.option(
    "--peer-tls-cert",
    type=_FILE,
    help="Parameter server: client certificate for tls:// backups that require one.",
)
@click.option("--peer-tls-key", type=_FILE, help="The private key of --peer-tls-cert.")
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
    auth_timeout: float,
    max_tensors: int,
    max_uploads: int,
    uploads_per_client: int,
    resumable_min_bytes: int,
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
    backups: tuple[str, ...],
    standby: bool,
    failover_timeout: float,
    peer_token_file: Path | None,
    peer_tls_ca: Path | None,
    peer_tls_cert: Path | None,
    peer_tls_key: Path | None,
    threads: int | None,
    metrics_port: int | None,
    metrics_host: str | None,
    metrics_connections: int,
    log_level: str | None,
) -> None:
    """Serve a tensor store, which is also a parameter server, until SIGINT or SIGTERM."""
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
    )
    if policy is not None and ps_server.restore(policy.directory):
        click.echo(f"resumed from a checkpoint in {policy.directory}: step {ps_server.step}")
    server = Server(
        store,
        stall_timeout=stall_timeout,
        security=security,
        max_connections=max_connections,
        idle_timeout=idle_timeout,
        auth_timeout=auth_timeout,
        extensions=[ps_server, DigestService(store)],
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        metrics_connections=metrics_connections,
        max_uploads=max_uploads,
        uploads_per_client=uploads_per_client,
        resumable_min_bytes=resumable_min_bytes,
    )
    run(_serve(server, listen + grpc_listen, ready_file))


def _host_param(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(check_cert_host(v) for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


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


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--host", "hosts", multiple=True, metavar="NAME|IP", callback=_host_param,
    help="Also issue the server certificate for this DNS name or IP address, as clients on other "
    "hosts reach the server (repeatable; localhost, 127.0.0.1 and ::1 are always included).",
)  # fmt: skip
@click.option("--days", type=click.IntRange(min=1), default=365, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace certificates already in DIRECTORY.")
def certs(directory: Path, hosts: tuple[str, ...], days: int, overwrite: bool) -> None:
    """Write a development CA and server/client certificates into DIRECTORY (not for production).

    A client checks that the name it connects to (tls://NAME:PORT) is in the server certificate:
    give every name and address other hosts use with --host, e.g. --host trainer-0 --host 10.0.0.5."""
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


async def _serve(server: Server, urls: tuple[str, ...], ready_file: Path | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        addresses = await server.start(*urls)
        for address in addresses:
            click.echo(f"tensorwire serving on {address}")  # click.echo flushes: a pipe reader sees it now
        if server.exporter is not None:
            click.echo(f"tensorwire metrics on {server.exporter.url}")
        if ready_file is not None:
            _write_atomic(ready_file, "".join(f"{a}\n" for a in addresses).encode())
        await stop.wait()
    finally:
        await server.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a fresh temporary file and a rename, so a reader never sees a half-written file
    (and a link planted at either name is replaced, never written through)."""
    write_file(path, lambda f: f.write(data))


# -- put / get -------------------------------------------------------------------------------------
@main.command()
@click.argument("name")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@server_option
@click.option("--key", help="Which tensor of FILE to send, when it holds several.")
def put(name: str, file: Path, server: str, key: str | None) -> None:
    """Store the tensor in FILE (.safetensors, .npy, .pt/.pth) under NAME."""
    tensor = load_tensor(file, key)
    nbytes = tensor.numel() * tensor.element_size()
    with _connect(server) as client, _progress(nbytes, f"put {name}") as advance:
        start = time.perf_counter()
        version = client.put(name, tensor, progress=advance)
        elapsed = time.perf_counter() - start
    click.echo(f"{name}  version {version}  {nbytes} bytes  {_rate(nbytes, elapsed)}")


@main.command()
@click.argument("name")
@click.option(
    "-o", "--output", "output", required=True, type=click.Path(dir_okay=False, path_type=Path),
    help="File to write: .safetensors, .npy, .pt or .pth.",
)  # fmt: skip
@server_option
@click.option("--key", help="Tensor key inside a .safetensors output (default: NAME).")
def get(name: str, output: Path, server: str, key: str | None) -> None:
    """Fetch NAME into a file."""
    fmt = _format_of(output)
    if not output.parent.is_dir():  # fail before the transfer, not after it
        raise CliError(f"cannot write {output}: directory {output.parent} does not exist")
    with _connect(server) as client:
        meta = client.stat(name)  # the size for the bar, and a dtype check before any bytes move
        _check_writable(meta, fmt)
        with _progress(meta.nbytes, f"get {name}") as advance:
            start = time.perf_counter()
            tensor = client.get(name, progress=advance)
            elapsed = time.perf_counter() - start
    save_tensor(tensor, output, key or name)
    nbytes = tensor.numel() * tensor.element_size()
    click.echo(f"{name}  -> {output}  {nbytes} bytes  {_rate(nbytes, elapsed)}")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"


@contextlib.contextmanager
def _progress(total: int, what: str) -> Iterator[Callable[[int], None] | None]:
    """A rich bar on stderr for big transfers; yields the client's progress callback (or None)."""
    if total <= PROGRESS_MIN_BYTES:
        yield None
        return
    console = Console(stderr=True)
    # markup=False: the description holds a tensor name, which is not rich markup.
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
               TransferSpeedColumn())  # fmt: skip
    # Drawn only on a terminal: in a log or a pipe a bar is just noise.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(printable(what, 200), total=total)
        # Called on the client's event loop thread; Progress.advance takes its own lock.
        yield lambda n: bar.advance(task, n)


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise CliError(f"{path}: unsupported file type {suffix or '(none)'!r}; use {', '.join(FORMATS)}")
    return ".pt" if suffix == ".pth" else suffix


def load_tensor(path: Path, key: str | None) -> torch.Tensor:
    """The tensor in ``path``: the file's only tensor, or the one under ``key``."""
    fmt = _format_of(path)
    if fmt == ".safetensors":
        return _load_safetensors(path, key)
    try:  # a boundary with arbitrary user files: any failure to parse is the file's fault
        loaded: object = (
            _load_npy(path) if fmt == ".npy" else torch.load(path, map_location="cpu", weights_only=True)
        )
    except (CliError, OSError):
        raise
    except Exception as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    return _pick(loaded, key, path)


def _load_npy(path: Path) -> torch.Tensor:
    import numpy as np

    array = np.load(path, allow_pickle=False)
    if not isinstance(array, np.ndarray):
        raise CliError(f"{path} is not a single .npy array")
    if not array.dtype.isnative:  # torch only wraps native byte order
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(array)


def _load_safetensors(path: Path, key: str | None) -> torch.Tensor:
    from safetensors import safe_open

    try:  # safe_open reads only the header and the one tensor asked for, not the whole file
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            chosen = _choose_key(keys, key, path)
            tensor: torch.Tensor = f.get_tensor(chosen)
            return tensor
    except CliError:
        raise
    except Exception as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc


def _pick(loaded: object, key: str | None, path: Path) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        if key is not None:
            raise CliError(f"--key {key!r} given, but {path} holds a single tensor")
        return loaded
    if isinstance(loaded, Mapping):
        chosen = _choose_key([str(k) for k in loaded], key, path)
        value = loaded[chosen]
        if isinstance(value, torch.Tensor):
            return value
        raise CliError(f"{path}: {chosen!r} is not a tensor but a {type(value).__name__}")
    raise CliError(f"{path} holds a {type(loaded).__name__}: expected a tensor or a dict of tensors")


def _choose_key(keys: list[str], key: str | None, path: Path) -> str:
    shown = ", ".join(keys[:20]) + (f", ... ({len(keys)} in all)" if len(keys) > 20 else "")
    if key is None:
        if len(keys) == 1:
            return keys[0]
        raise CliError(f"{path} holds {len(keys)} tensors; pick one with --key ({shown or 'none'})")
    if key not in keys:
        raise CliError(f"no key {key!r} in {path}; it holds: {shown or 'nothing'}")
    return key


def _check_writable(meta: TensorMeta, fmt: str) -> None:
    if fmt == ".npy" and meta.dtype not in _NUMPY_DTYPES:
        raise CliError(
            f"{meta.name!r} is {dtype_name(meta.dtype)}, which numpy has no dtype for; "
            "write .safetensors or .pt instead"
        )


def save_tensor(tensor: torch.Tensor, path: Path, key: str) -> None:
    """Write ``tensor`` to ``path`` in the format its suffix names, atomically: into a fresh
    temporary file (never one planted under a guessable name), then renamed over ``path``."""
    fmt = _format_of(path)
    if fmt == ".npy":
        import numpy as np

        write_file(path, lambda f: np.save(f, tensor.numpy(), allow_pickle=False))
    elif fmt == ".pt":
        write_file(path, lambda f: torch.save(tensor, f))
    else:
        data = _safetensors_bytes(tensor, path, key)
        write_file(path, lambda f: f.write(data))


def _safetensors_bytes(tensor: torch.Tensor, path: Path, key: str) -> bytes:
    import safetensors.torch

    try:
        data: bytes = safetensors.torch.save({key: tensor.contiguous()})
    except Exception as exc:  # e.g. a dtype the safetensors format has no code for
        raise CliError(f"cannot write {path.suffix}: {exc}") from exc
    return data


# -- ls / stat / rm --------------------------------------------------------------------------------
def meta_dict(meta: TensorMeta) -> dict[str, Any]:
    """The JSON form of a tensor's metadata (``ls --json``, ``stat --json``)."""
    return {
        "name": meta.name,
        "dtype": dtype_name(meta.dtype),
        "shape": list(meta.shape),
        "nbytes": meta.nbytes,
        "version": meta.version,
    }


@main.command("ls")
@click.argument("prefix", default="")
@server_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls(prefix: str, server: str, as_json: bool) -> None:
    """List stored tensors (whose names start with PREFIX)."""
    with _connect(server) as client:
        metas = client.list(prefix)
    if as_json:
        click.echo(json.dumps([meta_dict(m) for m in metas], indent=2))
        return
    table = Table("name", "dtype", "shape", "bytes", "version")
    for meta in metas:  # names come from the server: escaped, never markup or escape sequences
        table.add_row(markup(meta.name), dtype_name(meta.dtype), _shape(meta), f"{meta.nbytes:,}",
                      str(meta.version))  # fmt: skip
    Console().print(table)


def _shape(meta: TensorMeta) -> str:
    return "[" + ", ".join(str(d) for d in meta.shape) + "]"


@main.command()
@click.argument("name")
@server_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def stat(name: str, server: str, as_json: bool) -> None:
    """Show the metadata of NAME."""
    with _connect(server) as client:
        meta = client.stat(name)
    if as_json:
        click.echo(json.dumps(meta_dict(meta), indent=2))
        return
    for field, value in meta_dict(meta).items():
        click.echo(f"{field:8} {printable(value)}")


@main.command()
@click.argument("name")
@server_option
def rm(name: str, server: str) -> None:
    """Remove NAME."""
    with _connect(server) as client:
        client.delete(name)
    click.echo(f"removed {name}")


# -- demo / bench ----------------------------------------------------------------------------------
@main.command()
@click.option("--mode", default="async", show_default=True, help="sync, async or ssp:<s>.")
@click.option(
    "--epochs", type=click.IntRange(min=1), default=12, show_default=True, help="Passes over the data."
)
@click.option(
    "--transfer", is_flag=True, help="Instead: round-trip a state dict and a big tensor, report GB/s."
)
@click.option("--size-mb", type=click.IntRange(min=1), default=64, show_default=True, help="With --transfer.")
def demo(mode: str, epochs: int, transfer: bool, size_mb: int) -> None:
    """Train an MLP on the digits data set with 2 parameter servers and 2 workers (processes).

    Exits 1, saying why, if the test accuracy misses the demo's target (95%: the default 12
    epochs reach it; a couple of epochs do not)."""
    from tensorwire.cli import demo as demo_module
    from tensorwire.ps.server import Mode

    if transfer:
        demo_module.main(size_mb=size_mb)
        return
    try:
        mode = str(Mode.parse(mode))  # before any process starts, not as a worker's crash
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--mode") from exc
    result = demo_module.train(mode=mode, epochs=epochs)
    accuracy, target = float(result["accuracy"]), demo_module.TARGET_ACCURACY
    if accuracy < target:
        raise CliError(f"test accuracy {accuracy:.2%} missed the demo's {target:.0%} target after {epochs} "
                       f"epoch(s) (the default {demo_module.DEFAULT_EPOCHS} reach it)")  # fmt: skip


# -- ps --------------------------------------------------------------------------------------------
@main.group()
def ps() -> None:
    """The parameter server."""


ps.add_command(serve, "serve")  # one process of a cluster: the same server, which runs the PS ops


@ps.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--servers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option(
    "--replicas", type=click.IntRange(min=0), default=0, show_default=True,
    help="Standby backups per server (each takes over when its primary dies).",
)  # fmt: skip
@click.option(
    "--timeout", type=click.FloatRange(min=1), default=None, help="Stop everything after this many s."
)
@click.argument("script", nargs=-1, required=True, type=click.UNPROCESSED)
def ps_launch(
    servers: int, workers: int, replicas: int, timeout: float | None, script: tuple[str, ...]
) -> None:
    """Start SERVERS parameter servers and WORKERS copies of `python SCRIPT ARGS...` on this machine.

    Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and TENSORWIRE_SERVERS, which
    `tensorwire.ps.Worker` reads. Exits with the first failing worker's code."""
    from tensorwire.ps import launch

    raise SystemExit(launch.run(script, servers, workers, timeout, replicas))


@ps.command("stats")
@click.argument("servers", nargs=-1, required=True, callback=_url_param)
@security_options
def ps_stats(servers: tuple[str, ...]) -> None:
    """Print each parameter server's view of its job (JSON): mode, step, workers, staleness."""
    from tensorwire.ps.worker import server_stats

    security = ClientOptions(**client_options()).security()
    click.echo(json.dumps(server_stats(list(servers), security=security), indent=2))


@main.command("status")
@click.argument("servers", nargs=-1, required=True)
@click.option(
    "--metrics", "metrics_urls", metavar="URL", multiple=True,
    help="Also scrape this metrics endpoint (http://host:port/metrics), e.g. of a gRPC-only server.",
)  # fmt: skip
@click.option(
    "--timeout", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
    help="Seconds to wait for each server; one that does not answer in time is shown as down.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print JSON: each server's STATUS, metrics summary.")
@click.option("--tls-ca", type=_FILE, help="CA of the servers' certificates (tls://).")
@click.option("--token", metavar="TOKEN", help=f"The servers' shared token (default: ${TOKEN_ENV}).")
def status(
    *, servers: tuple[str, ...], metrics_urls: tuple[str, ...], timeout: float, as_json: bool,
    tls_ca: Path | None, token: str | None,
) -> None:  # fmt: skip
    """A one-screen summary of a cluster: which SERVERS are up, their role, shards, load and lag.

    SERVERS are URLs (HOST:PORT means tcp://); `a|b` names the replicas of one slot. Each is asked
    STATUS, and its metrics (serve --metrics-port) are scraped: only http(s) URLs, at most 16 MiB.
    Each server's whole probe ends within 3 x --timeout, however slowly it answers. Exits 1 if any
    server is down."""
    from tensorwire.cli import status as cluster

    nodes = cluster.collect([*servers, *metrics_urls], timeout, tls_ca=str(tls_ca) if tls_ca else None,
                            token=token)  # fmt: skip
    if as_json:
        click.echo(json.dumps([n.to_dict() for n in nodes], indent=2, default=str))
    else:
        console = Console()
        Console(width=None if console.is_terminal else 160).print(cluster.render(nodes))
    if not all(n.up for n in nodes):
        raise SystemExit(1)


@ps.command("plan")
@click.argument("model", type=_FILE)
@click.option("--servers", type=click.IntRange(min=1), required=True, help="How many servers.")
@click.option("--split-bytes", metavar="SIZE", default=None, help="Split tensors above this size.")
@click.option("--json", "as_json", is_flag=True, help="Print the placement as JSON.")
def ps_plan(model: Path, servers: int, split_bytes: str | None, as_json: bool) -> None:
    """Show which bytes of MODEL (.safetensors, or .pt/.pth state dict) live on which server."""
    from tensorwire.ps import plan

    bound = parse_size(split_bytes) if split_bytes is not None else None
    placement = plan(_param_specs(model), servers, bound)
    click.echo(placement.to_json() if as_json else placement.describe())


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


@main.group()
def bench() -> None:
    """Benchmarks."""


def _bench_module(name: str) -> Any:
    """A benchmark, imported by name: they are optional and heavy, and load only when asked for."""
    try:
        return importlib.import_module(f"tensorwire.bench.{name}")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("tensorwire.bench"):
            raise
        raise CliError(f"the {name} benchmark (tensorwire.bench.{name}) is not installed") from exc


def _add_benchmark(name: str, summary: str) -> None:
    """``tensorwire bench NAME ARGS...``: each benchmark parses its own options (--help goes to it)."""

    def command(ctx: click.Context) -> None:
        _bench_module(name).main(list(ctx.args))

    command.__doc__ = summary
    settings = {"ignore_unknown_options": True, "allow_extra_args": True}
    bench.command(name, context_settings=settings, add_help_option=False)(click.pass_context(command))


# The table of benchmarks is tensorwire.bench.BENCHMARKS; `bench all` runs them all into a report.
for _benchmark in BENCHMARKS.values():
    _add_benchmark(_benchmark.name, _benchmark.summary)
_add_benchmark("all", "Every benchmark, then report.json, report.md and plots (--out DIR, --quick).")


def _add_dataset() -> None:
    from tensorwire.cli.dataset import build  # its commands use the helpers above

    main.add_command(build())


_add_dataset()
