"""The ``tensorwire`` command line: ``main`` is the click group (app.py); ``options`` holds what the
commands share (also imported from here); each command group lives in a module of its own."""

from tensorwire.cli.app import main
from tensorwire.cli.options import (
    SERVER_ENV,
    CliError,
    client_options,
    connection_options,
    parse_size,
    parse_url,
    security_options,
)

__all__ = [
    "SERVER_ENV",
    "CliError",
    "client_options",
    "connection_options",
    "main",
    "parse_size",
    "parse_url",
    "security_options",
]
