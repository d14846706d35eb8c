"""``{tensorwire-options}``: every option of every ``tensorwire`` command in one table.

Built from the click commands themselves, so the table cannot drift from the CLI: one row per
option spelling, the commands that take it, its environment variable and default, and its help
(taken from the first command that has it; where commands differ, each is listed).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import click
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


@dataclass
class Row:
    option: str
    commands: list[str] = field(default_factory=list)
    envvar: str = ""
    helps: dict[str, list[str]] = field(default_factory=dict)  # help text -> commands


def commands(group: click.Group, path: str = "tensorwire") -> Iterator[tuple[str, click.Command]]:
    """(``tensorwire ps serve``, its command) for every leaf command, in the group's order."""
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, f"{path} {name}")
        else:
            yield f"{path} {name}", command


def rows(group: click.Group) -> list[Row]:
    by_option: dict[str, Row] = {}
    for path, command in commands(group):
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            spelling = " / ".join(param.opts + param.secondary_opts)
            row = by_option.setdefault(spelling, Row(spelling))
            row.commands.append(path.removeprefix("tensorwire "))
            if isinstance(param.envvar, str) and param.envvar:
                row.envvar = param.envvar
            text = (param.help or "").strip()
            if param.show_default and param.default not in (None, False, ()):
                text += f" [default: {param.default}]"
            row.helps.setdefault(text, []).append(path.removeprefix("tensorwire "))
    return sorted(by_option.values(), key=lambda r: r.option.lstrip("-").lower())


def _entry(*children: nodes.Node) -> nodes.entry:
    entry = nodes.entry()
    entry.extend(children)
    return entry


def _text(text: str, literal: bool = False) -> nodes.paragraph:
    return nodes.paragraph("", "", nodes.literal(text, text) if literal else nodes.Text(text))


def _help_cell(row: Row) -> nodes.entry:
    if len(row.helps) == 1:
        return _entry(_text(next(iter(row.helps))))
    return _entry(*(_text(f"{', '.join(cmds)}: {text}") for text, cmds in row.helps.items()))


def table(group: click.Group) -> nodes.table:
    headers = ["option", "commands", "environment", "what it does"]
    tgroup = nodes.tgroup(cols=len(headers))
    tgroup.extend(nodes.colspec(colwidth=w) for w in (18, 22, 14, 46))
    tgroup += nodes.thead("", nodes.row("", *(_entry(_text(h)) for h in headers)))
    body = nodes.tbody()
    for row in rows(group):
        body += nodes.row(
            "",
            _entry(_text(row.option, literal=True)),
            _entry(_text(", ".join(row.commands))),
            _entry(_text(row.envvar, literal=True)) if row.envvar else _entry(),
            _help_cell(row),
        )
    tgroup += body
    return nodes.table("", tgroup, classes=["tensorwire-options"])


class OptionsTable(SphinxDirective):
    """``{tensorwire-options}``: the table above, of ``tensorwire.cli.app.main``."""

    def run(self) -> list[nodes.Node]:
        from tensorwire.cli.app import main

        return [table(main)]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("tensorwire-options", OptionsTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
