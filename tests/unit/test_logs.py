"""Structured logging: one line per event, key=value or JSON, set up from the CLI."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from tensorwire import logs
from tensorwire.cli import main


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_lines_are_key_value_pairs_one_per_event(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("info", "text", out)
    log = logging.getLogger("tensorwire.test")
    logs.event(log, logging.WARNING, "connection refused", peer="127.0.0.1:5", reason="the token is wrong")
    log.info("a message\nwith a newline")
    log.debug("below the level")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # the traceback stays on its event's line
    first = lines[0]
    assert "level=warning" in first and "logger=tensorwire.test" in first
    assert 'event="connection refused"' in first and "peer=127.0.0.1:5" in first
    assert 'reason="the token is wrong"' in first and first.startswith("ts=")
    assert 'event="a message\\nwith a newline"' in lines[1]
    assert "level=error" in lines[2] and "ValueError: boom" in lines[2]


def test_json_lines_parse_and_carry_the_fields(restore_logging: None) -> None:
    out = io.StringIO()
    logs.configure("debug", "json", out)
    log = logging.getLogger("tensorwire.test")
    logs.event(log, logging.INFO, "server started", addresses=["tcp://a:1", "grpc://a:2"], pid=7)
    try:
        raise RuntimeError("x")
    except RuntimeError:
        log.exception("request %d failed", 3)
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert docs[0]["event"] == "server started" and docs[0]["level"] == "info"
    assert docs[0]["addresses"] == ["tcp://a:1", "grpc://a:2"] and docs[0]["pid"] == 7
    assert docs[1]["event"] == "request 3 failed" and "RuntimeError: x" in docs[1]["error"]


def test_configure_refuses_unknown_settings() -> None:
    with pytest.raises(ValueError, match="log level"):
        logs.configure("loud")
    with pytest.raises(ValueError, match="log format"):
        logs.configure("info", "xml")


def test_the_cli_group_sets_level_and_format(restore_logging: None) -> None:
    result = CliRunner().invoke(main, ["--log-level", "debug", "--log-format", "json", "ps", "--help"])
    assert result.exit_code == 0, result.output
    assert logging.getLogger().level == logging.DEBUG
    (handler,) = [h for h in logging.getLogger().handlers if h.get_name() == "tensorwire"]
    assert isinstance(handler.formatter, logs.JsonFormatter)
    result = CliRunner().invoke(main, ["--log-format", "yaml", "ps", "--help"])
    assert result.exit_code == 2 and "yaml" in result.output


def test_the_default_handler_follows_sys_stderr(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CLI command run in-process (a test runner swapping stderr) leaves no handler bound to a
    stream that is closed afterwards: records go to whatever sys.stderr is when they come."""
    logs.configure("info", "text")
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    logging.getLogger("tensorwire.test").info("one")
    first.close()
    monkeypatch.setattr("sys.stderr", second)
    logging.getLogger("tensorwire.test").info("two")
    assert "event=two" in second.getvalue()
