"""What every ``tensorwire`` command shares: the error it ends with, the parsing of sizes and URLs,
and the options that say which server to reach and how to reach it securely.

The command modules (``serve``, ``tensors``, ``ps``, ``dataset``, ...) build their options from
these; nothing here imports a command module. A command that talks to servers takes
``security_options`` (or ``server_option``, which adds ``--server``), then opens its client with
``open_client(server)``, or builds one with ``ClientOptions(**client_options())``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import click

from tensorwire import transport as transports
from tensorwire.cli.text import printable
from tensorwire.client.core import Client, connect
from tensorwire.security import TOKEN_ENV, TlsFiles, load_token
from tensorwire.types import Address, GiB, KiB, MiB

DEFAULT_URL = "tcp://127.0.0.1:7070"
SERVER_ENV = "TENSORWIRE_SERVER"
FILE = click.Path(exists=True, dir_okay=False, path_type=Path)  # an existing file, as a Path

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": 10**3,
    "m": MiB, "mib": MiB, "mb": 10**6,
    "g": GiB, "gib": GiB, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
_CLIENT_META = "tensorwire.client_options"


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


def size_param(ctx: click.Context, param: click.Parameter, value: str) -> int:
    """A click callback: a positive ``parse_size``."""
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc
    if size <= 0:
        raise click.BadParameter(f"size must be positive, not {value!r}", ctx, param)
    return size


def url_param(ctx: click.Context, param: click.Parameter, value: str | tuple[str, ...]) -> Any:
    """A click callback: ``parse_url`` of one value, or of each of a tuple of them."""
    try:
        return parse_url(value) if isinstance(value, str) else tuple(parse_url(v) for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


# -- reaching a server -----------------------------------------------------------------------------
def _client_param(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Collect --tls-ca/--tls-cert/--tls-key/--token/--token-file for ``client_options`` (they are
    not arguments)."""
    if value is not None and param.name is not None:
        ctx.meta.setdefault(_CLIENT_META, {})[param.name] = value


def server_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """--server and the options that say how to reach it securely."""
    command = security_options(command)
    return click.option(
        "--server", metavar="URL", callback=url_param, envvar=SERVER_ENV, default=DEFAULT_URL,
        show_default=True, help=f"Server address (env {SERVER_ENV}): tcp://, tls://, grpc://, grpcs://.",
    )(command)  # fmt: skip


def security_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--tls-ca, --tls-cert, --tls-key, --token, --token-file: how to reach servers securely (see
    ``client_options``)."""
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
        click.option("--token-file", type=file, callback=_client_param, expose_value=False,
                     help="Read the token from this file (off the command line: e.g. a mounted Secret)."),
    ]  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


def client_options() -> dict[str, Any]:
    """This command's ``security_options``, as keyword arguments of ``connect``/``ClientOptions``:
    ``tls`` (a ``TlsFiles``, when a --tls-* flag is given) and ``token`` (``--token-file`` read)."""
    given = dict(click.get_current_context().meta.get(_CLIENT_META, {}))
    options: dict[str, Any] = {}
    files = [given.get(name) for name in ("tls_cert", "tls_key", "tls_ca")]
    if any(files):
        options["tls"] = TlsFiles(*(Path(f) if f else None for f in files))
    token_file = given.get("token_file")
    if token_file is not None and "token" in given:
        raise click.UsageError("give --token or --token-file, not both")
    if "token" in given:
        options["token"] = given["token"]
    if token_file is not None:
        try:
            options["token"] = load_token(Path(token_file))
        except ValueError as exc:
            raise CliError(str(exc)) from exc
    return options


def open_client(server: str) -> Client:
    """A client of ``server`` with this command's security options."""
    return connect(server, **client_options())
