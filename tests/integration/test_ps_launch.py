"""Parameter-server jobs as real processes: `tensorwire ps launch`, torchrun, and the demo."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

from tensorwire.cli import demo
from tensorwire.ps.launch import local_servers
from tensorwire.ps.worker.rendezvous import SERVERS_ENV
from tensorwire.testing.process import wait_for

TIMEOUT = 180

WORKER_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from tensorwire.ps import Worker, SGD

    torch.set_num_threads(1)
    rank, out, how = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
    if how == "fail" and rank == 1:
        sys.exit(3)  # rank 0 is left waiting for step 0: the launcher must stop it
    if how == "killed" and rank == 1:
        os.kill(os.getpid(), 9)
    if how == "hang" and rank == 1:
        open(f"{out}/hanging", "w").close()
        sys.stdin.read()  # until the launcher ends this process
    servers = how.removeprefix("servers=") if how.startswith("servers=") and rank == 0 else None
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    with Worker(model, servers, "sync", SGD(lr=0.1), timeout=60) as worker:
        for step in range(10):
            torch.manual_seed(10 * step + rank)
            model(torch.randn(4, 8)).pow(2).mean().backward()
            worker.step()
    torch.save(model.state_dict(), f"{out}/rank{rank}.pt")
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(WORKER_SCRIPT)
    return path


def run(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` (without the variables a worker reads the servers or its rank from) in a
    session of its own, so that on a timeout the whole tree it started is killed, not only it."""
    env = {k: v for k, v in os.environ.items() if k not in (SERVERS_ENV, "RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the tree is left (nothing, normally)
        proc.wait()
    return proc.returncode, output


def assert_same_trained_model(out: Path, ranks: int) -> None:
    states = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(ranks)]
    for state in states[1:]:
        assert all(torch.equal(state[k], states[0][k]) for k in state)
    torch.manual_seed(0)
    assert not torch.equal(states[0]["weight"], torch.nn.Linear(8, 2).weight.detach())  # it trained


def test_ps_launch_runs_a_local_cluster_with_replicas(script: Path, tmp_path: Path) -> None:
    """Two replicated servers (the tests below launch unreplicated ones)."""
    cmd = [sys.executable, "-m", "tensorwire.cli", "ps", "launch", "--servers", "2", "--workers", "2",
           "--replicas", "1", str(script), str(tmp_path), "env"]  # fmt: skip
    code, output = run(cmd)
    assert code == 0, output
    assert_same_trained_model(tmp_path, 2)


def test_ps_launch_stops_the_others_when_a_worker_fails(script: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tensorwire.cli", "ps", "launch", "--workers", "2",
           str(script), str(tmp_path), "fail"]  # fmt: skip
    code, output = run(cmd)
    assert code == 3, output
    assert not (tmp_path / "rank0.pt").exists()
    code, output = run([*cmd[:-1], "killed"])
    assert code == 128 + signal.SIGKILL, output  # as a shell reports a signal


def test_sigterm_to_the_launcher_ends_the_whole_cluster(script: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "tensorwire.cli", "ps", "launch", "--workers", "2",
           str(script), str(tmp_path), "hang"]  # fmt: skip
    launcher = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)
    try:
        wait_for((tmp_path / "hanging").exists, TIMEOUT, "worker 1 to start")
        cluster = psutil.Process(launcher.pid).children(recursive=True)
        assert len(cluster) >= 4  # 2 servers, 2 workers
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(TIMEOUT) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(cluster, timeout=TIMEOUT)
        assert not alive, f"left running: {alive}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_torchrun_workers_find_the_servers_through_its_store(script: Path, tmp_path: Path) -> None:
    """Only rank 0 is told where the servers are; rank 1 reads them from torchrun's store."""
    with local_servers(2) as urls:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script), str(tmp_path), "servers=" + ",".join(urls)]  # fmt: skip
        code, output = run(cmd)
    assert code == 0, output[-3000:]
    assert_same_trained_model(tmp_path, 2)


def test_demo_trains_the_digits_to_the_target_accuracy() -> None:
    result = demo.train(mode="async")
    assert float(result["accuracy"]) >= demo.TARGET_ACCURACY
    assert int(result["bytes_pushed"]) > 0 and int(result["bytes_pulled"]) > 0
    assert int(result["steps"]) == 2 * 12 * 23  # 2 workers, 12 epochs of 23 batches of 32
