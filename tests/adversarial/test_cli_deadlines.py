"""Client-side commands have an overall deadline, not only per-read timeouts: ``dataset fetch``
and ``dataset scatter`` against a server that accepts connections and never answers give up at
``--deadline`` (their per-request timeouts alone would wait minutes), naming it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tensorwire import cli
from tensorwire._aio import Deadline
from tensorwire.client import ClientOptions
from tensorwire.dataset import scatter
from tensorwire.dataset.fetch import fetch
from tensorwire.errors import TransferTimeout

PATIENT = ClientOptions(timeout=60.0, connect_timeout=60.0, retries=3)  # minutes, without a deadline
BOUND = 15.0  # "did not wait for its per-request timeouts": far below them, far above the deadline


@pytest.fixture
def silent() -> Iterator[str]:
    """A server that completes TCP handshakes (the kernel does) and never says a word."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"


def test_fetch_gives_up_at_its_deadline(silent: str, tmp_path: Path) -> None:
    deadline = Deadline.after(1.0, "dataset fetch (--deadline 1s)")
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="--deadline 1s"):
        fetch(silent, tmp_path / "out", options=ClientOptions(**_fields(PATIENT), deadline=deadline))
    assert time.monotonic() - start < BOUND


def test_scatter_gives_up_at_its_deadline(silent: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 1000)
    start = time.monotonic()
    deadline = Deadline.after(1.0, "dataset scatter (--deadline 1s)")
    report = scatter(src, [silent], options=PATIENT, deadline=deadline)
    assert time.monotonic() - start < BOUND
    assert not report.ok and "--deadline 1s" in (report.nodes[0].error or "")


@pytest.mark.parametrize("command", ["fetch", "scatter"])
def test_the_cli_commands_take_a_deadline(silent: str, tmp_path: Path, command: str) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x")
    args = (
        ["dataset", "fetch", silent, "--out", str(tmp_path / "out")]
        if command == "fetch"
        else ["dataset", "scatter", str(tmp_path / "src"), "--to", silent, "--json"]
    )
    start = time.monotonic()
    result = CliRunner().invoke(cli.main, [*args, "--deadline", "1"])
    assert time.monotonic() - start < BOUND
    assert result.exit_code == 1 and "--deadline 1s" in result.output, result.output
    assert result.output.splitlines()[-1].startswith("error: ")


def _fields(options: ClientOptions) -> dict[str, object]:
    return {name: getattr(options, name) for name in ("timeout", "connect_timeout", "retries")}
