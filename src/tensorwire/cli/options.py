"""What every ``tensorwire`` command shares: the error it ends with, the parsing of sizes and URLs,
the options that say which server to reach and how, and the one way an option is renamed.

The command modules (``serve``, ``tensors``, ``ps``, ``dataset``, ...) build their options from
these; nothing here imports a command module. Every command that talks to servers takes one
vocabulary, ``connection_options`` (--tls-ca, --tls-cert, --tls-key, --token, --token-file,
--timeout; ``server_option`` adds ``--server``), then opens its client with ``open_client(server)``,
or builds one with ``ClientOptions(**client_options())``. Options of a command's own listener are
named for it (``serve --tls-cert`` is the server's certificate, ``dashboard --page-tls-cert`` the
page's). A renamed option keeps its old spelling for one release (``renamed_option``), with one
warning line on stderr (``warn_deprecated``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from tensorwire import transport as transports
from tensorwire.cli.text import printable
from tensorwire.client.core import Client, ClientOptions, connect
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
_DEPRECATED_META = "tensorwire.deprecated"
REMOVED_IN = "0.3.0"  # the release that drops the deprecated spellings (``renamed_option``)
CLIENT_DEFAULTS = ClientOptions()  # a client's own defaults: --timeout where a command has none of its own
_CONNECT_MAX = CLIENT_DEFAULTS.connect_timeout
Command = Callable[..., Any]
EACH_WAIT = (  # what --timeout bounds, where a command says no more
    f"Seconds to wait for each answer of a server, and to connect (at most {_CONNECT_MAX:g} s of it); "
    "each retry waits again."
)


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


# -- deprecated spellings --------------------------------------------------------------------------
def warn_deprecated(old: str, new: str, *, note: str = "") -> None:
    """Say on stderr, in one line, that ``old`` is deprecated and what to say instead.

    The one mechanism for every deprecated spelling of the command line: a line on stderr, which a
    user running the command sees (a ``DeprecationWarning`` is hidden outside ``__main__``), and a
    test or a wrapper script can find. ``note`` adds what else changes then."""
    extra = f"; {note}" if note else ""
    message = f"{old} is deprecated, say {new} (the old spelling goes in {REMOVED_IN}{extra})"
    click.echo(f"tensorwire: warning: {message}", err=True)


def renamed_option(new: str, old: str, name: str, **attrs: Any) -> Callable[[Command], Command]:
    """Option ``new`` (``attrs`` as for ``click.option``; its value is the argument ``name``), also
    taken under its old spelling ``old`` until ``REMOVED_IN``, with a warning (``warn_deprecated``).

    The old spelling is a hidden option of its own, so that the command knows which one was said.
    click processes the options given on the command line first, in their order, then the others:
    when only ``old`` is given, its value is recorded before ``new`` is processed, and ``new``
    (not given) takes it; when both are given, whichever comes second refuses the pair. For options
    that take a value (not flags, not ``required``: a missing ``new`` fails before it can look)."""
    given = attrs.pop("callback", None)
    key = f"{_DEPRECATED_META}.{name}"

    def take_old(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None or not _said(ctx, param.name or ""):
            return
        if _said(ctx, name):
            raise click.UsageError(f"give {new} or the deprecated {old}, not both", ctx)
        warn_deprecated(old, new)
        ctx.meta[key] = value

    def take_new(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if key in ctx.meta:
            if _said(ctx, name):
                raise click.UsageError(f"give {new} or the deprecated {old}, not both", ctx)
            value = ctx.meta[key]
        return given(ctx, param, value) if given is not None else value

    hidden = {k: v for k, v in attrs.items() if k in ("type", "metavar", "nargs", "multiple")}
    attrs["help"] = f"{attrs.get('help', '')} (Formerly {old}, deprecated.)".strip()

    def decorate(command: Command) -> Command:
        command = click.option(old, f"deprecated_{name}", callback=take_old, expose_value=False, hidden=True,
                               **hidden)(command)  # fmt: skip
        return click.option(new, name, callback=take_new, **attrs)(command)

    return decorate


def _said(ctx: click.Context, name: str) -> bool:
    """Whether the option whose value is ``name`` was given (command line or environment)."""
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


# -- reaching a server -----------------------------------------------------------------------------
def _client_param(ctx: click.Context, param: click.Parameter, value: str | float | None) -> None:
    """Collect --tls-ca/--tls-cert/--tls-key/--token/--token-file/--timeout for ``client_options``
    (they are not arguments: every command that talks to a server takes them alike)."""
    if value is not None and param.name is not None:
        ctx.meta.setdefault(_CLIENT_META, {})[param.name] = value


def server_option(command: Command) -> Command:
    """--server and the options that say how to reach it (``connection_options``, the client's
    default --timeout)."""
    command = connection_options()(command)
    return click.option(
        "--server", metavar="URL", callback=url_param, envvar=SERVER_ENV, default=DEFAULT_URL,
        show_default=True, help=f"Server address (env {SERVER_ENV}): tcp://, tls://, grpc://, grpcs://.",
    )(command)  # fmt: skip


def connection_options(
    timeout: float = CLIENT_DEFAULTS.timeout, timeout_help: str | None = None
) -> Callable[[Command], Command]:
    """--tls-ca, --tls-cert, --tls-key, --token, --token-file, --timeout: how every command that
    talks to a server reaches it (``client_options``). ``timeout`` is this command's default for
    --timeout (a status probe waits less than a put); ``timeout_help`` says what it bounds, where
    that is more than each network wait of a client."""
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
        click.option("--timeout", type=click.FloatRange(min=0.05), default=timeout, show_default=True,
                     metavar="SECONDS", callback=_client_param, expose_value=False,
                     help=timeout_help or EACH_WAIT),
    ]  # fmt: skip

    def decorate(command: Command) -> Command:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


security_options = connection_options()  # the set with the client's default --timeout (one name, kept)


def given_security() -> dict[str, str]:
    """The --tls-*/--token/--token-file values this command was given, by parameter name (a copy:
    ``tensorwire dashboard`` takes its deprecated page certificate out of it)."""
    given = click.get_current_context().meta.get(_CLIENT_META, {})
    return {name: str(value) for name, value in given.items() if name != "timeout"}


def client_security(given: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``given`` (default: ``given_security()``) as keyword arguments of ``connect``/``ClientOptions``:
    ``tls`` (a ``TlsFiles``, when a --tls-* flag is given) and ``token`` (``--token-file`` read)."""
    given = given_security() if given is None else given
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


def client_timeout() -> float:
    """This command's --timeout, in seconds."""
    given = click.get_current_context().meta.get(_CLIENT_META, {})
    return float(given.get("timeout", CLIENT_DEFAULTS.timeout))


def client_options() -> dict[str, Any]:
    """This command's ``connection_options`` as keyword arguments of ``connect``/``ClientOptions``:
    ``client_security()``, and --timeout as each request's ``timeout`` and, up to the client's
    default, its ``connect_timeout`` (so that a long --timeout for a big put does not make a
    down host a long wait too)."""
    timeout = client_timeout()
    return {**client_security(), "timeout": timeout, "connect_timeout": min(timeout, _CONNECT_MAX)}


def open_client(server: str) -> Client:
    """A client of ``server`` with this command's connection options."""
    return connect(server, **client_options())
