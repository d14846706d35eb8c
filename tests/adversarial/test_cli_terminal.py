"""What a hostile server says never reaches the terminal raw: tensor names with rich markup or
escape sequences (``ls``, ``stat``, error lines), STATUS fields of any type or text, and metrics
URLs that are not http(s) (never opened); ``status`` ends within its deadline against a metrics
endpoint that drips its answer."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from click.testing import CliRunner

from tensorwire import cli
from tensorwire.errors import KeyNotFound
from tensorwire.server import Server, ServerThread
from tensorwire.store import TensorStore
from tensorwire.types import TensorMeta

EVIL = "\x1b]0;pwned\x07\x1b[2J[red]red[/red][link=file:///etc/passwd]click[/link]\u202e"


class HostileStore(TensorStore):
    """A store whose names and errors are chosen to attack the terminal that shows them."""

    def list(self, prefix: str = "", limit: int = 0) -> list[TensorMeta]:  # type: ignore[override]
        return [TensorMeta(EVIL, torch.float32, (2,), 8, 1)]

    def stat(self, names: Any) -> list[TensorMeta]:  # type: ignore[override]
        if names == ["missing"]:
            raise KeyNotFound(f"no tensor {EVIL}\nsecond line")
        return [TensorMeta(EVIL, torch.float32, (2,), 8, 1)]


def _clean(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, repr(text)


@pytest.fixture
def hostile() -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0"], store=HostileStore()) as srv:
        yield srv


def test_ls_and_stat_show_names_escaped_not_rendered(hostile: ServerThread) -> None:
    runner = CliRunner()
    for args in (["ls"], ["stat", "x"]):
        result = runner.invoke(cli.main, [*args, "--server", hostile.url])
        assert result.exit_code == 0, result.output
        _clean(result.output)
        assert "[red]red[/red]" in result.output.replace("\n", "") or "[red]" in result.output, result.output
        assert "\\x1b" in result.output


def test_a_servers_error_message_is_one_escaped_line(hostile: ServerThread) -> None:
    result = CliRunner().invoke(cli.main, ["stat", "missing", "--server", hostile.url])
    assert result.exit_code == 1
    _clean(result.output)
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, repr(result.output)


class HostileStatus(Server):
    doc: ClassVar[dict[str, Any]] = {}

    def status(self) -> dict[str, Any]:
        return {**self.doc, "in_flight": 1}  # the server takes the asker's own request off


def _status_server(doc: dict[str, Any]) -> ServerThread:
    srv = ServerThread(["tcp://127.0.0.1:0"])
    HostileStatus.doc = doc
    srv.server.__class__ = HostileStatus  # the same server, answering STATUS with ``doc``
    return srv


@pytest.mark.parametrize(
    "doc",
    [
        {"metrics": "file:///etc/passwd", "ps": {"role": EVIL, "epoch": "x", "backups": {EVIL: {"up": 1}}}},
        {"metrics": 7, "store": [], "ps": {"role": 3, "live": "all", "backups": [1], "primary_silence_s": 0}},
        {"metrics": "http://u:p@127.0.0.1:1/x", "store": {"bytes": 10**400, "capacity": -1}, "requests": "9"},
    ],
)
def test_status_survives_any_answer_and_opens_no_other_scheme(doc: dict[str, Any], tmp_path: Any) -> None:
    with _status_server(doc) as srv:
        result = CliRunner().invoke(cli.main, ["status", srv.url, "--timeout", "2"])
        as_json = CliRunner().invoke(cli.main, ["status", srv.url, "--timeout", "2", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert as_json.exception is None or isinstance(as_json.exception, SystemExit), as_json.output
    _clean(result.output)
    _clean(as_json.output)
    assert "up" in result.output and "Traceback" not in result.output
    assert "not scraped" in as_json.output  # the reported URL was refused, not opened


def test_status_metrics_urls_of_other_schemes_are_refused(tmp_path: Any) -> None:
    secret = tmp_path / "secret"
    secret.write_text("tensorwire_store_bytes 42\n")
    result = CliRunner().invoke(cli.main, ["status", f"file://{secret}", "--timeout", "1", "--json"])
    assert result.exit_code == 1 and "42" not in result.output.replace("localhost:42", "")
    assert '"up": false' in result.output


@pytest.fixture
def dripping() -> Iterator[str]:
    """An HTTP endpoint that answers one byte every 0.2 s, for up to 60 s: each read is in time."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                for byte in b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 300:
                    if stop.wait(0.2):
                        break
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_status_has_an_overall_deadline_against_a_dripping_endpoint(dripping: str) -> None:
    start = time.monotonic()
    result = CliRunner().invoke(cli.main, ["status", dripping, "--timeout", "0.5", "--json"])
    elapsed = time.monotonic() - start
    assert result.exit_code == 1, result.output
    assert elapsed < 10, f"status took {elapsed:.1f}s against a 0.5 s timeout"  # a deadline, not speed
    assert "no complete answer within" in result.output
