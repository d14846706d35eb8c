"""``tensorwire probe``, the Helm chart's readiness probe, against a real server on loopback: 0 when
it answers STATUS, 1 with one line saying why when it is down, refuses the token, or never answers."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tensorwire.cli import main
from tensorwire.security import write_token_file
from tensorwire.server.process import ServerProcess


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token_file(tmp_path_factory.mktemp("probe") / "token")


@pytest.fixture(scope="module")
def server(token_file: Path) -> Iterator[ServerProcess]:
    with ServerProcess(capacity="64MiB", extra=["--token-file", str(token_file)]) as served:
        yield served


def probe(*args: str) -> Result:
    return CliRunner().invoke(main, ["probe", *args, "--timeout", "1"])


def one_error_line(result: Result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_server_that_answers_is_ready(server: ServerProcess, token_file: Path) -> None:
    done = probe(server.url, "--token-file", str(token_file))
    assert done.exit_code == 0, done.output
    assert f"{server.url} answered STATUS" in done.stdout


def test_a_wrong_or_missing_token_is_not_ready(server: ServerProcess, tmp_path: Path) -> None:
    wrong = write_token_file(tmp_path / "wrong")
    assert "token" in one_error_line(probe(server.url, "--token-file", str(wrong))).lower()
    one_error_line(probe(server.url))  # no token at all


def test_token_and_token_file_together_are_refused(server: ServerProcess, token_file: Path) -> None:
    done = probe(server.url, "--token", "x", "--token-file", str(token_file))
    assert done.exit_code == 2 and "not both" in done.output


def test_a_stopped_server_is_not_ready(token_file: Path) -> None:
    with ServerProcess(capacity="64MiB", extra=["--token-file", str(token_file)]) as stopped:
        url = stopped.url
        assert probe(url, "--token-file", str(token_file)).exit_code == 0
    assert "connect" in one_error_line(probe(url, "--token-file", str(token_file)))


def test_a_server_that_never_answers_times_out(token_file: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never speaks
        port = silent.getsockname()[1]
        started = time.monotonic()
        line = one_error_line(probe(f"tcp://127.0.0.1:{port}", "--token-file", str(token_file)))
        took = time.monotonic() - started
    assert took < 5, took  # --timeout 1 bounds the whole probe
    assert "1s" in line or "timed out" in line or "waited" in line, line
