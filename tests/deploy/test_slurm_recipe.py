"""The Slurm recipe in deploy/slurm, run for real on loopback: two "server nodes" (127.0.0.1 and
127.0.0.2, a stand-in `scontrol` on PATH) each run tw-servers.sh, and tw-env.sh's
TENSORWIRE_SERVERS must name two slots whose backups sit on the other node, with every server up
and a worker training through them. Ending a node's script ends both of its servers.

With etcd (TW_ETCD=1: one etcd for the job on the first server node; or TW_COORDINATOR): the first
node's script runs a real etcd (Debian's etcd-server) and every server is started with the slot's
--coordinator, --slot and --advertise, checked with a stand-in `tensorwire` that records its
arguments; a job with real servers and etcd runs once `tensorwire ps serve` has those flags."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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


# -- leadership from etcd (TW_ETCD, TW_COORDINATOR; issue 37) ---------------------------------------
needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd on PATH (Debian: etcd-server)")


def _env_var(env: dict[str, str], name: str) -> subprocess.CompletedProcess[str]:
    script = f'source {SLURM / "tw-env.sh"} && echo "${{{name}:-}}"'
    return subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def test_tw_env_names_the_jobs_own_etcd_or_the_one_given(slurm_env: dict[str, str]) -> None:
    assert _env_var(slurm_env, "TW_COORDINATOR").stdout.strip() == ""  # off unless asked for
    own = _env_var({**slurm_env, "TW_ETCD": "1", "TW_ETCD_PORT": "2479"}, "TW_COORDINATOR")
    assert own.stdout.strip() == f"etcd://{NODES[0]}:2479/tensorwire"  # on the first server node
    given = "etcds://etcd-0:2379,etcd-1:2379/tensorwire/team-a"
    assert _env_var({**slurm_env, "TW_COORDINATOR": given}, "TW_COORDINATOR").stdout.strip() == given
    both = _env_var({**slurm_env, "TW_ETCD": "1", "TW_COORDINATOR": given}, "TW_COORDINATOR")
    assert both.returncode == 2 and "not both" in both.stderr


def _free_ports(host: str, count: int) -> int:
    """A port P with P..P+count-1 free on ``host``."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        if port + count <= 65536 and all(_free(host, p) for p in range(port, port + count)):
            return port
    raise RuntimeError("no free ports")


@pytest.fixture
def etcd_env(slurm_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {**slurm_env, "TW_ETCD": "1", "TW_ETCD_PORT": str(_free_ports(NODES[0], 2))}


def _argv(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _flag(argv: list[str], flag: str) -> str:
    (value,) = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]
    return value


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as reply:
            return b'"health":"true"' in reply.read()
    except OSError:
        return False


@needs_etcd
def test_with_etcd_the_first_node_runs_it_and_every_replica_names_its_slot(
    etcd_env: dict[str, str], tmp_path: Path
) -> None:
    bin_dir, argv_dir = tmp_path / "stub", tmp_path / "argv"
    bin_dir.mkdir()
    argv_dir.mkdir()
    stub = bin_dir / "tensorwire"  # records its arguments, then stands in for a running server
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {argv_dir}/$$\nexec sleep 300\n')
    stub.chmod(0o755)
    env = {**etcd_env, "PATH": f"{bin_dir}:{etcd_env['PATH']}"}
    port, etcd_port = int(env["TW_PORT"]), int(env["TW_ETCD_PORT"])
    script = str(SLURM / "tw-servers.sh")
    scripts = [
        subprocess.Popen(["bash", script], env={**env, "SLURMD_NODENAME": node}, start_new_session=True)
        for node in NODES
    ]
    try:
        deadline = time.monotonic() + READY
        while len(list(argv_dir.iterdir())) < 4:  # two servers per node, once etcd answers
            assert time.monotonic() < deadline, "the node scripts did not start their servers"
            assert all(s.poll() is None for s in scripts), "a node script ended"
            time.sleep(0.05)
        time.sleep(0.2)  # the stand-ins' files are written whole by now
        servers = [_argv(path) for path in argv_dir.iterdir()]

        url = f"http://{NODES[0]}:{etcd_port}"
        assert _healthy(url)
        (etcd,) = [p for p in psutil.Process(scripts[0].pid).children() if p.name() == "etcd"]
        assert _flag(etcd.cmdline(), "--listen-client-urls") == url  # that node's address only
        assert (Path(env["TW_CHECKPOINTS"]) / "etcd" / "member").is_dir()  # its data node-local
        assert not [p for p in psutil.Process(scripts[1].pid).children() if p.name() == "etcd"]

        by_slot: dict[str, list[list[str]]] = {}
        for argv in servers:
            assert argv[:2] == ["ps", "serve"]
            assert _flag(argv, "--coordinator") == f"etcd://{NODES[0]}:{etcd_port}/tensorwire"
            assert _flag(argv, "--lease-ttl") == "3"
            assert _flag(argv, "--advertise") == _flag(argv, "--listen")
            by_slot.setdefault(_flag(argv, "--slot"), []).append(argv)
        assert sorted(by_slot) == ["slot0", "slot1"]
        for slot, (one, other) in by_slot.items():
            assert _flag(one, "--backup") == _flag(other, "--advertise")  # each names the other
            assert _flag(other, "--backup") == _flag(one, "--advertise")
            primary = next(a for a in (one, other) if "--standby" not in a)  # campaigns first
            assert _flag(primary, "--listen") == f"tcp://{NODES[int(slot[-1])]}:{port}"

        scripts[0].send_signal(signal.SIGTERM)  # ending the node's script ends its etcd too
        assert scripts[0].wait(30) != 0
        _, alive = psutil.wait_procs([etcd], timeout=30)
        assert not alive and not _healthy(url)
    finally:
        for script in scripts:
            if script.poll() is None:
                os.killpg(script.pid, signal.SIGKILL)
            script.wait(10)


def needs_coordinator_flags() -> None:
    """Skip until ``tensorwire ps serve`` takes the coordinator's flags (issue 37, being added)."""
    from tensorwire.cli import main

    serve = main.commands["ps"].commands["serve"]
    names = {name for param in serve.params for name in getattr(param, "opts", ())}
    flags = ("--coordinator", "--slot", "--advertise", "--lease-ttl")
    missing = [flag for flag in flags if flag not in names]
    if missing:
        pytest.skip(f"tensorwire ps serve has no {', '.join(missing)} yet (issue 37)")


@needs_etcd
def test_with_etcd_a_worker_trains_through_a_killed_primary(etcd_env: dict[str, str]) -> None:
    needs_coordinator_flags()
    port = int(etcd_env["TW_PORT"])
    script = str(SLURM / "tw-servers.sh")
    scripts = [
        subprocess.Popen(["bash", script], env={**etcd_env, "SLURMD_NODENAME": node}, start_new_session=True)
        for node in NODES
    ]
    try:
        servers = _servers(etcd_env)
        token = (Path(etcd_env["TW_SECRETS"]) / "token").read_text()
        for url in servers.replace("|", ",").split(","):
            _wait_up(url, token)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
        with ps.Worker(model, servers, "sync", ps.SGD(lr=0.1), rank=0, world_size=1, token=token,
                       timeout=30) as worker:  # fmt: skip
            losses = []
            for step in range(8):
                # Slot 1's primary: etcd's lease passes to its backup on the first node. (Not slot 0's:
                # its node's script would end, and with it the job's etcd, which runs on that node.)
                if step == 4:
                    (primary,) = [
                        p for p in psutil.Process(scripts[1].pid).children()
                        if f"tcp://{NODES[1]}:{port}" in p.cmdline() and "--standby" not in p.cmdline()
                    ]  # fmt: skip
                    primary.kill()
                loss = F.cross_entropy(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                worker.step()
                losses.append(loss.item())
        assert losses[-1] < losses[0]
    finally:
        for one in scripts:
            if one.poll() is None:
                os.killpg(one.pid, signal.SIGKILL)
            one.wait(10)
