"""The Slurm recipe in deploy/slurm, run for real on loopback: two "server nodes" (127.0.0.1 and
127.0.0.2, a stand-in `scontrol` on PATH) each run tw-servers.sh, and tw-env.sh's
TENSORWIRE_SERVERS must name two slots whose backups sit on the other node, with every server up
and a worker training through them. Ending a node's script ends both of its servers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F

from tensorwire import connect, ps
from tensorwire.errors import TensorwireError
from tensorwire.security import write_token_file

SLURM = Path(__file__).resolve().parents[2] / "deploy" / "slurm"
NODES = ("127.0.0.1", "127.0.0.2")
READY = 60.0  # seconds the four servers get to answer


def _free_pair() -> int:
    """A port P with P and P+1 free on both node addresses."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind((NODES[0], 0))
            port: int = sock.getsockname()[1]
        if port < 65535 and all(_free(host, p) for host in NODES for p in (port, port + 1)):
            return port
    raise RuntimeError("no free port pair")


def _free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


@pytest.fixture
def slurm_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # `scontrol show hostnames LIST`, for a comma-separated LIST
    scontrol.write_text('#!/bin/sh\necho "$3" | tr , "\\n"\n')
    scontrol.chmod(0o755)
    (bin_dir / "tensorwire").symlink_to(Path(sys.executable).parent / "tensorwire")
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    write_token_file(secrets / "token")
    write_token_file(secrets / "peer")
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST_HET_GROUP_0": ",".join(NODES),
        "TW_PORT": str(_free_pair()),
        "TW_SECRETS": str(secrets),
        "TW_CAPACITY": "256MiB",
        "TW_CHECKPOINTS": str(tmp_path / "checkpoints"),
    }


@pytest.fixture
def nodes(slurm_env: dict[str, str]) -> Iterator[list[subprocess.Popen[bytes]]]:
    script = str(SLURM / "tw-servers.sh")
    scripts = [
        subprocess.Popen(["bash", script], env={**slurm_env, "SLURMD_NODENAME": node}, start_new_session=True)
        for node in NODES
    ]
    try:
        yield scripts
    finally:
        for script in scripts:
            if script.poll() is None:
                os.killpg(script.pid, signal.SIGKILL)
            script.wait(10)


def _servers(env: dict[str, str]) -> str:
    out = subprocess.run(["bash", "-c", f"source {SLURM / 'tw-env.sh'} && tw_servers"], env=env,
                         capture_output=True, text=True, check=True, timeout=30)  # fmt: skip
    return out.stdout.strip()


def _wait_up(url: str, token: str) -> None:
    deadline = time.monotonic() + READY
    while True:
        try:
            with connect(url, token=token, connect_timeout=2.0) as client:
                client.ping()
                return
        except TensorwireError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_backups_on_the_other_node_and_a_worker_trains(
    slurm_env: dict[str, str], nodes: list[subprocess.Popen[bytes]]
) -> None:
    port = int(slurm_env["TW_PORT"])
    servers = _servers(slurm_env)
    a, b = NODES
    assert servers == f"tcp://{a}:{port}|tcp://{b}:{port + 1},tcp://{b}:{port}|tcp://{a}:{port + 1}"
    token = (Path(slurm_env["TW_SECRETS"]) / "token").read_text()
    for url in servers.replace("|", ",").split(","):
        _wait_up(url, token)
    assert all(script.poll() is None for script in nodes)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with ps.Worker(model, servers, "sync", ps.SGD(lr=0.1), rank=0, world_size=1, token=token,
                   timeout=30) as worker:  # fmt: skip
        losses = []
        for _ in range(5):
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            worker.step()
            losses.append(loss.item())

    assert losses[-1] < losses[0]


def test_ending_a_node_script_ends_both_its_servers(nodes: list[subprocess.Popen[bytes]]) -> None:
    script = nodes[0]
    deadline = time.monotonic() + READY
    children: list[psutil.Process] = []
    while len(children) < 2:  # the node's backup and primary
        assert time.monotonic() < deadline, "tw-servers.sh did not start its two servers"
        children = psutil.Process(script.pid).children()
        time.sleep(0.05)
    script.send_signal(signal.SIGTERM)
    assert script.wait(30) != 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"servers outlived their node script: {alive}"
