"""The ``tensorwire`` command: run a server, move tensors between files and a server, run the demo.

::

    tensorwire serve --listen 0.0.0.0:7070 --capacity 16GiB --data-dir /var/lib/tensorwire
    tensorwire put model/w weights.safetensors --key layer0.weight
    tensorwire put --generation policy ./checkpoint   # a save_pretrained folder, one generation
    tensorwire get model/w -o w.npy
    tensorwire ls model/ --json

Every command that talks to a server takes ``--server`` (or ``TENSORWIRE_SERVER``). Every error a
command meets ends it with one ``error: <message>`` line on stderr and exit status 1, never a
traceback (``--log-level debug`` logs the traceback of an unexpected one). Strings a server chose
(tensor names, error messages, status fields) are escaped before they reach the terminal
(``tensorwire.cli.text``), and files are written without following links planted where they go
(``tensorwire._fs``).

This module is the group ``main``: its logging options, its error handling, and the table of the
command modules it is made of. The modules import downwards only::

    app  ->  ps  ->  serve  ->  ps_options  ->  server_options  ->  options  ->  text
    app  ->  tensors, bench, dataset, demo, status, dashboard  ->  options  ->  text
"""

from __future__ import annotations

import logging
from typing import Any

import click

from tensorwire import __version__, _extensions, logs
from tensorwire.cli import bench, dashboard, dataset, demo, ps, serve, status, tensors
from tensorwire.cli.options import CliError
from tensorwire.errors import TensorwireError
from tensorwire.wire import codec  # noqa: F401 - loaded here, so that --version can say how it runs


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


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"tensorwire, version {__version__}\n{_extensions.describe()}")
        ctx.exit()


@click.group("tensorwire", cls=_Group)
@click.option(
    "--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
    help="Show the version, and whether the hot path runs compiled, and exit.",
)  # fmt: skip
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


# Every command, from the module that holds it (click lists them sorted by name).
_COMMANDS: tuple[click.Command, ...] = (
    serve.serve, serve.certs,
    tensors.put, tensors.get, tensors.ls, tensors.stat, tensors.rm,
    ps.ps, status.status_command, status.probe_command,
    demo.command, bench.bench, dataset.dataset, dashboard.dashboard,
)  # fmt: skip
for _command in _COMMANDS:
    main.add_command(_command)
