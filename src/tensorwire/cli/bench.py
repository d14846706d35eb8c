"""``tensorwire bench NAME ARGS...``: the benchmarks of ``tensorwire.bench``, one subcommand each.

The table of benchmarks is ``tensorwire.bench.BENCHMARKS``; a benchmark's module is imported only
when it runs (they are optional and heavy), and parses its own arguments, ``--help`` included.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from tensorwire.bench import BENCHMARKS
from tensorwire.cli.options import CliError


@click.group()
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
