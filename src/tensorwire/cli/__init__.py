"""The ``tensorwire`` command line: ``main`` is the click group (main.py); each command group
lives in a module of its own."""

from tensorwire.cli.app import (
    SERVER_ENV,
    CliError,
    client_options,
    main,
    parse_size,
    parse_url,
    security_options,
)

__all__ = ["SERVER_ENV", "CliError", "client_options", "main", "parse_size", "parse_url", "security_options"]
