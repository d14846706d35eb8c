"""Every error a CLI command meets is one ``error:`` line and a non-zero exit, never a traceback:
bad URLs, unreachable servers, missing and unreadable files, permission errors, odd inputs; and
``get -o`` never writes through a link planted at its output or temporary names."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tensorwire
from tensorwire import cli
from tensorwire.server import ServerThread


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0"]) as srv:
        with tensorwire.connect(srv.url) as c:
            c.put("w", torch.arange(6, dtype=torch.float32))
            c.put("bf", torch.ones(3, dtype=torch.bfloat16))
        yield srv


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_error_line(args: list[str], code: int = 1) -> str:
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == code, (args, result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    if code == 1:
        assert result.output.startswith("error: ") and result.output.count("\n") == 1, (args, result.output)
    return result.output


def test_runtime_errors_are_one_line(server: ServerThread, tmp_path: Path) -> None:
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not numpy at all")
    for suffix in (".pt", ".safetensors"):
        bad.with_suffix(suffix).write_bytes(b"not a model at all")
    unreadable = tmp_path / "secret.npy"
    np.save(unreadable, np.ones(2))
    unreadable.chmod(0)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    url = f"tcp://127.0.0.1:{_closed_port()}"
    cases = [
        ["ls", "--server", url],
        ["stat", "nope", "--server", server.url],
        ["get", "nope", "-o", str(tmp_path / "x.npy"), "--server", server.url],
        ["get", "bf", "-o", str(tmp_path / "x.npy"), "--server", server.url],  # no numpy bfloat16
        ["get", "w", "-o", str(tmp_path / "x.txt"), "--server", server.url],
        ["get", "w", "-o", str(tmp_path / "nodir" / "x.npy"), "--server", server.url],
        ["put", "a", str(bad), "--server", server.url],
        ["put", "a/../b", str(tmp_path / "bad.npy"), "--server", server.url],
        ["put", "a", str(tmp_path / "gone.npy"), "--server", server.url],  # click: "does not exist"
        ["rm", "nope", "--server", server.url],
        ["ps", "stats", url],
        ["dataset", "fetch", url, "--out", str(tmp_path / "o"), "--deadline", "5"],
        ["dataset", "fetch", str(tmp_path), "--out", str(tmp_path / "o")],  # a dir with no data set
        ["certs", str(bad / "sub")],  # under a file
        ["get", "w", "-o", "/proc/tensorwire-test.npy", "--server", server.url],  # not even root writes
        ["demo", "--mode", "nonsense"],
        ["ps", "plan", str(bad.with_suffix(".pt")), "--servers", "2"],
        ["ps", "plan", str(bad.with_suffix(".safetensors")), "--servers", "2"],
    ]
    if os.geteuid() != 0:  # root reads and writes through permissions
        cases += [
            ["put", "a", str(unreadable), "--server", server.url],
            ["get", "w", "-o", str(ro / "x.npy"), "--server", server.url],
            ["certs", str(ro / "certs")],
        ]
    for args in cases:
        code = 2 if args[0] == "demo" or any("gone.npy" in a for a in args) else 1  # click usage errors
        _one_error_line(args, code)


@pytest.mark.parametrize("url", ["tcp://[::1", "tcp://host:99999", "foo://x:1", "tcp://:1", "::::"])
def test_bad_urls_are_usage_errors(url: str) -> None:
    result = CliRunner().invoke(cli.main, ["ls", "--server", url])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output


def test_get_never_writes_through_a_planted_temporary_name(server: ServerThread, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    out = tmp_path / "out.npy"
    # The names the old code wrote to first: guessable from the pid (here the test's own).
    os.symlink(victim, tmp_path / f".out.{os.getpid()}.tmp.npy")
    os.symlink(victim, out)
    result = CliRunner().invoke(cli.main, ["get", "w", "-o", str(out), "--server", server.url])
    assert result.exit_code == 0, result.output
    assert victim.read_bytes() == b"keep me"
    assert not out.is_symlink() and np.array_equal(np.load(out), np.arange(6, dtype=np.float32))
