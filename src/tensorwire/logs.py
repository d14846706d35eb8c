"""Structured logging: one line per event, as ``key=value`` pairs or as JSON.

tensorwire logs through the standard ``logging`` module under the ``tensorwire`` logger tree
(``tensorwire.server``, ``tensorwire.ps``, ...). ``configure`` installs one handler on stderr that
writes each record as one line, whatever it holds (a message with a newline, a traceback)::

    ts=2025-01-01T12:00:00.123Z level=warning logger=tensorwire.server event="connection refused" peer=...

    {"ts": "2025-01-01T12:00:00.123Z", "level": "warning", "logger": "tensorwire.server", ...}

An event is a fixed message plus fields: ``event(log, logging.WARNING, "connection refused",
peer=...)``; a plain ``log.warning("...%s", x)`` still works (its text is the event). The CLI sets
this up from ``tensorwire --log-level LEVEL --log-format text|json`` (or the environment variables
``TENSORWIRE_LOG_LEVEL`` / ``TENSORWIRE_LOG_FORMAT``, which servers started by ``ps launch`` inherit).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
LEVEL_ENV = "TENSORWIRE_LOG_LEVEL"
FORMAT_ENV = "TENSORWIRE_LOG_FORMAT"
_FIELDS = "tensorwire_fields"  # the LogRecord attribute ``event`` puts its fields under
_HANDLER = "tensorwire"  # the name of the handler ``configure`` installs (and replaces)


def event(logger: logging.Logger, level: int, name: str, **fields: Any) -> None:
    """Log the event ``name`` with ``fields`` (rendered as key=value, or as JSON members)."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={_FIELDS: fields}, stacklevel=2)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "ts": _timestamp(record.created),
        "level": record.levelname.lower(),
        "logger": record.name,
        "event": record.getMessage(),
    }
    doc.update(getattr(record, _FIELDS, None) or {})
    if record.exc_info:
        doc["error"] = logging.Formatter().formatException(record.exc_info)
    return doc


def _timestamp(created: float) -> str:
    millis = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


class KeyValueFormatter(logging.Formatter):
    """``key=value`` pairs on one line; values with spaces, quotes or newlines are quoted JSON strings."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_value(value)}" for key, value in _fields(record).items())


def _value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if not text or any(c in text for c in ' "=\n\r\t\\'):
        return json.dumps(text)  # escapes newlines: a traceback stays on its line
    return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes (as logging's last-resort handler
    does): a command run in-process by a test runner that swaps stderr leaves no handler on a
    closed stream behind."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always sys.stderr


def configure(level: str = "warning", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Send tensorwire's (and every library's) log records at ``level`` or above to ``stream``
    (stderr), one line each, in format ``fmt``. Calling it again replaces the handler."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    handler.set_name(_HANDLER)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


__all__ = ["FORMATS", "LEVELS", "JsonFormatter", "KeyValueFormatter", "configure", "event"]
