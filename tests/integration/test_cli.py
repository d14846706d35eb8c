"""The ``tensorwire`` command against real server processes: serve, put/get in every file format,
ls, stat, rm, errors, persistence across a restart, the demo and the bench hook."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner, Result

import tensorwire.cli.demo
from tensorwire import cli

START_TIMEOUT = 60.0  # a cold start imports torch; slow CI machines need the margin
STOP_TIMEOUT = 15.0


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    while not ready.exists():  # the server renames the file into place: existing means complete
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        if time.monotonic() > deadline:
            pytest.fail(f"server not ready after {START_TIMEOUT}s:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    return ready.read_text().splitlines()[0]


@contextlib.contextmanager
def serving(workdir: Path, *extra: str) -> Iterator[Served]:
    """A ``tensorwire serve`` process on a free loopback port; always ended on the way out."""
    tag = uuid.uuid4().hex[:8]
    ready, log = workdir / f"ready-{tag}", workdir / f"server-{tag}.log"
    cmd = [sys.executable, "-m", "tensorwire.cli", "serve", "--listen", "127.0.0.1:0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--ready-file", str(ready), "--capacity", "1GiB", *extra], stdout=out, stderr=out
        )
    try:
        yield Served(proc, _wait_ready(proc, ready, log), log)
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("server")) as served:
        yield served


def run_cli(*args: str, at: Served | None = None, code: int = 0) -> Result:
    """Run the CLI in-process (against the server ``at``); check its exit status."""
    argv = [*args, "--server", at.url] if at is not None else list(args)
    result = CliRunner().invoke(cli.main, argv, catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert raw(got) == raw(want)


def load_any(path: Path, key: str) -> torch.Tensor:
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(str(path))[key]
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path, allow_pickle=False))
    loaded = torch.load(path, weights_only=True)
    assert isinstance(loaded, torch.Tensor)
    return loaded


def special_bf16() -> torch.Tensor:
    t = torch.randn(3, 5).to(torch.bfloat16)
    t[0, 0], t[0, 1], t[0, 2] = float("nan"), -0.0, float("inf")  # values == would not tell apart
    return t


# -- against one server ----------------------------------------------------------------------------
def test_serve_prints_its_address(server: Served) -> None:
    assert f"tensorwire serving on {server.url}\n" in server.log.read_text()
    assert server.url.startswith("tcp://127.0.0.1:")


def test_put_ls_stat_get_rm_in_every_format(server: Served, tmp_path: Path) -> None:
    bf16 = special_bf16()
    f64 = np.asfortranarray(np.random.default_rng(0).standard_normal((4, 6))).astype(">f8")  # odd layout
    i32 = torch.arange(-50, 50, dtype=torch.int32).reshape(10, 10)
    safetensors.torch.save_file({"only": bf16}, str(tmp_path / "a.safetensors"))
    np.save(tmp_path / "b.npy", f64)
    torch.save(i32, tmp_path / "c.pt")
    want = {"fmt/st": bf16, "fmt/npy": torch.from_numpy(f64.astype("=f8")), "fmt/pt": i32}
    files = {"fmt/st": "a.safetensors", "fmt/npy": "b.npy", "fmt/pt": "c.pt"}

    for name, file in files.items():
        out = run_cli("put", name, str(tmp_path / file), at=server).output
        assert name in out and "version" in out and "GB/s" in out

    listed = json.loads(run_cli("ls", "fmt/", "--json", at=server).stdout)
    assert [m["name"] for m in listed] == sorted(want)
    versions = {m["name"]: m["version"] for m in listed}
    assert versions["fmt/st"] < versions["fmt/npy"] < versions["fmt/pt"]
    table = run_cli("ls", at=server).output
    assert all(name in table for name in want) and "bfloat16" in table

    stat = json.loads(run_cli("stat", "fmt/st", "--json", at=server).stdout)
    assert stat == {
        "name": "fmt/st",
        "dtype": "bfloat16",
        "shape": [3, 5],
        "nbytes": 30,
        "version": versions["fmt/st"],
    }

    for name, tensor in want.items():
        for suffix in (".safetensors", ".npy", ".pt", ".pth"):
            if suffix == ".npy" and tensor.dtype == torch.bfloat16:
                continue
            target = tmp_path / f"out-{name.replace('/', '_')}{suffix}"
            run_cli("get", name, "-o", str(target), at=server)
            assert_bit_exact(load_any(target, name), tensor)

    run_cli("rm", "fmt/pt", at=server)
    gone = run_cli("stat", "fmt/pt", at=server, code=1)
    assert "error: no tensor named 'fmt/pt'" in gone.output
    assert [m["name"] for m in json.loads(run_cli("ls", "fmt/", "--json", at=server).stdout)] == [
        "fmt/npy",
        "fmt/st",
    ]


def test_get_of_a_missing_key_exits_1_without_traceback(server: Served, tmp_path: Path) -> None:
    out = tmp_path / "missing.pt"
    cmd = [sys.executable, "-m", "tensorwire.cli", "get", "no/such", "-o", str(out), "--server", server.url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: no tensor named 'no/such'"
    assert not out.exists()


def test_keys_inside_files(server: Served, tmp_path: Path) -> None:
    two = tmp_path / "two.safetensors"
    safetensors.torch.save_file({"a": torch.ones(3), "b": torch.arange(4)}, str(two))
    assert "pick one with --key (a, b)" in run_cli("put", "k/x", str(two), at=server, code=1).output
    assert "no key 'zz'" in run_cli("put", "k/x", str(two), "--key", "zz", at=server, code=1).output
    run_cli("put", "k/b", str(two), "--key", "b", at=server)

    state = tmp_path / "state.pth"
    torch.save({"w": torch.full((2, 2), 7.0), "step": 3}, state)
    run_cli("put", "k/w", str(state), "--key", "w", at=server)
    assert "not a tensor" in run_cli("put", "k/s", str(state), "--key", "step", at=server, code=1).output
    assert "holds 2 tensors" in run_cli("put", "k/s", str(state), at=server, code=1).output

    got = tmp_path / "w.npy"
    run_cli("get", "k/w", "-o", str(got), at=server)
    assert_bit_exact(load_any(got, "k/w"), torch.full((2, 2), 7.0))
    got = tmp_path / "b.safetensors"
    run_cli("get", "k/b", "-o", str(got), "--key", "renamed", at=server)
    assert_bit_exact(load_any(got, "renamed"), torch.arange(4))


def test_file_errors(server: Served, tmp_path: Path) -> None:
    pickled = tmp_path / "obj.pt"
    torch.save({"w": torch.ones(1), "f": types.SimpleNamespace()}, pickled)  # weights_only refuses it
    assert "cannot read" in run_cli("put", "e/x", str(pickled), at=server, code=1).output
    bad = tmp_path / "x.csv"
    bad.write_text("1,2\n")
    assert "unsupported file type '.csv'" in run_cli("put", "e/x", str(bad), at=server, code=1).output

    safetensors.torch.save_file({"x": special_bf16()}, str(tmp_path / "bf.safetensors"))
    run_cli("put", "e/bf", str(tmp_path / "bf.safetensors"), at=server)
    npy = tmp_path / "bf.npy"
    assert "numpy has no dtype" in run_cli("get", "e/bf", "-o", str(npy), at=server, code=1).output
    assert not npy.exists()
    nowhere = str(tmp_path / "no" / "dir.pt")
    assert "does not exist" in run_cli("get", "e/bf", "-o", nowhere, at=server, code=1).output


def test_progress_bar_path(server: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.tensors, "PROGRESS_MIN_BYTES", 0)  # every transfer takes the big-tensor path
    tensor = torch.rand(1 << 18)
    torch.save(tensor, tmp_path / "p.pt")
    run_cli("put", "p/x", str(tmp_path / "p.pt"), at=server)
    run_cli("get", "p/x", "-o", str(tmp_path / "q.pt"), at=server)
    assert_bit_exact(load_any(tmp_path / "q.pt", "p/x"), tensor)


def test_server_from_environment(server: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.SERVER_ENV, server.url.removeprefix("tcp://"))  # HOST:PORT means tcp://
    assert isinstance(json.loads(run_cli("ls", "--json").stdout), list)


def test_unreachable_server_exits_1() -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        assert "error: cannot connect" in run_cli("ls", "--server", url, code=1).output


# -- server lifecycle ------------------------------------------------------------------------------
def test_data_dir_survives_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    tensor = special_bf16()
    safetensors.torch.save_file({"t": tensor}, str(tmp_path / "t.safetensors"))
    with serving(tmp_path, "--data-dir", str(data)) as first:
        run_cli("put", "keep/t", str(tmp_path / "t.safetensors"), at=first)
        before = json.loads(run_cli("stat", "keep/t", "--json", at=first).stdout)
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=STOP_TIMEOUT) == 0
    with serving(tmp_path, "--data-dir", str(data)) as second:
        after = json.loads(run_cli("stat", "keep/t", "--json", at=second).stdout)
        assert after == before
        run_cli("get", "keep/t", "-o", str(tmp_path / "back.safetensors"), at=second)
        assert_bit_exact(load_any(tmp_path / "back.safetensors", "keep/t"), tensor)
        second.proc.send_signal(signal.SIGINT)  # Ctrl-C ends it just as cleanly
        assert second.proc.wait(timeout=STOP_TIMEOUT) == 0


def test_serve_on_a_busy_port_exits_1() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = run_cli("serve", "--listen", f"127.0.0.1:{port}", code=1)
        assert "error: cannot listen on" in result.output


# -- arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "size"),
    [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("1024", 1024), ("4k", 4096),
     ("2 mb", 2_000_000), (str(2**62 + 1), 2**62 + 1)],
)  # fmt: skip
def test_parse_size(text: str, size: int) -> None:
    assert cli.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "1.2.3", "-5", "5 parsecs", "0x10"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        cli.parse_size(text)


def test_bad_arguments_are_usage_errors() -> None:
    assert "invalid size '12XB'" in run_cli("serve", "--capacity", "12XB", code=2).output
    assert "must be positive" in run_cli("serve", "--capacity", "0", code=2).output
    assert "unsupported address scheme" in run_cli("ls", "--server", "udp://h:1", code=2).output


def test_parse_url() -> None:
    assert cli.parse_url("127.0.0.1:7070") == "tcp://127.0.0.1:7070"
    assert cli.parse_url("[::1]:9") == "tcp://[::1]:9"
    assert cli.parse_url("tcp://localhost:1") == "tcp://localhost:1"


def test_version() -> None:
    assert tensorwire.__version__ in run_cli("--version").output


# -- demo and bench --------------------------------------------------------------------------------
def test_demo_runs() -> None:
    result = tensorwire.cli.demo.main(size_mb=8)
    assert result["bit_exact"] is True
    assert int(result["tensors"]) > 5
    assert float(result["put_gbps"]) > 0 and float(result["get_gbps"]) > 0


def test_bench_transfer_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str] | None] = []

    def fake_main(argv: list[str] | None = None) -> dict[str, Any]:
        seen.append(argv)
        return {}

    fake = types.ModuleType("tensorwire.bench.transfer")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorwire.bench.transfer", fake)
    args = ["--size", "1MiB", "--json", "--iters", "3", "--small-iters", "5", "--many", "10"]
    run_cli("bench", "transfer", *args)
    assert seen == [args]


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_ps_plan_shows_where_each_byte_lives(tmp_path: Path, suffix: str) -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
    state = {k: v.contiguous() for k, v in mlp.state_dict().items()}
    path = tmp_path / f"mlp{suffix}"
    if suffix == ".pt":
        torch.save(state, path)
    else:
        safetensors.torch.save_file(state, path)
    result = CliRunner().invoke(cli.main, ["ps", "plan", str(path), "--servers", "3"])
    assert result.exit_code == 0, result.output
    for name in state:
        assert name in result.output
    assert "server 2:" in result.output and "imbalance 1.0" in result.output
    as_json = CliRunner().invoke(cli.main, ["ps", "plan", str(path), "--servers", "2", "--json"])
    placement = json.loads(as_json.output)
    assert placement["servers"] == 2
