"""Every ``tensorwire ...`` command line in the README and the docs' shell blocks names a command
that exists and options it takes, parsed by the CLI's own parser (click): a renamed or invented
flag in a tutorial fails here, not in a newcomer's terminal. (The Python examples run for real:
tests/integration/test_doc_examples.py; the values a command line gives, files and addresses of
other hosts, are not checked here.)"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from tensorwire.cli.app import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
SHELL = re.compile(r"^\s*```(sh|bash|console|shell)\s*$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, command) of each command in the page's shell blocks, continuations joined."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if block := SHELL.match(lines[i]):
            console = block.group(1) == "console"  # a session: commands after "$ ", then their output
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                start, line = i + 1, lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i]
                if not console or line.lstrip().startswith("$ "):
                    yield start, line.strip().removeprefix("$ ")
                i += 1
        i += 1


def invocations(line: str) -> Iterator[list[str]]:
    """The argument lists of the ``tensorwire`` commands in one shell line (after env assignments,
    in each part of ``&&``, ``;`` and ``|`` chains; a comment ends the line)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return  # not a line a shell would take whole (a heredoc's body, say)
    command: list[str] = []
    for word in [*words, ";"]:
        if word in ("&&", "||", ";", "|"):
            while command and ASSIGNMENT.match(command[0]):
                command.pop(0)
            if command and command[0] == "tensorwire":
                yield command[1:]
            command = []
        else:
            command.append(word)


@functools.cache
def benchmark_options(name: str) -> frozenset[str]:
    """The options of ``tensorwire bench NAME``, which parses its own (argparse): read off its help."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        importlib.import_module(f"tensorwire.bench.{name}").main(["--help"])
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))


def check_benchmark(name: str, args: list[str]) -> None:
    unknown = [
        a.split("=", 1)[0]
        for a in args
        if a.startswith("--") and a.split("=", 1)[0] not in benchmark_options(name)
    ]
    if unknown:
        raise click.UsageError(f"bench {name} has no option {unknown[0]}")


def check(args: list[str]) -> None:
    """Resolve ``args`` down the command groups and parse the leaf's options with its own parser."""
    command: click.Command = main
    ctx = click.Context(main, info_name="tensorwire")
    while isinstance(command, click.Group):
        _, rest, _ = command.make_parser(ctx).parse_args(list(args))  # the group's own options
        if not rest or rest[0] in ("--help", "--version"):
            return
        name = rest[0]
        if name not in command.commands:
            raise click.UsageError(f"no command {name!r}")
        if command.name == "bench":
            check_benchmark(name, rest[1:])
            return
        command, args = command.commands[name], rest[1:]
        ctx = click.Context(command, info_name=name, parent=ctx, **command.context_settings)
    command.make_parser(ctx).parse_args(list(args))


def _commands() -> list[object]:
    params = []
    for page in PAGES:
        for number, line in shell_lines(page.read_text()):
            for args in invocations(line):
                where = f"{page.relative_to(ROOT).as_posix()}:{number}"
                params.append(pytest.param(args, id=f"{where}:{' '.join(args[:2])}"))
    return params


COMMANDS = _commands()


def test_the_docs_show_command_lines() -> None:
    assert len(COMMANDS) > 20, "the README and the tutorials show tensorwire's command lines"


@pytest.mark.parametrize("args", COMMANDS)
def test_a_documented_command_line_parses(args: list[str]) -> None:
    try:
        check(args)
    except click.ClickException as exc:
        pytest.fail(f"`tensorwire {shlex.join(args)}`: {exc.format_message()}")
