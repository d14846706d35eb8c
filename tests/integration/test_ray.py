"""tensorwire.ray on a local Ray cluster (2 CPUs, one node, started once for this module): the
digits job through servers and workers that Ray runs, a killed server actor failing over to its
standby, and no server process outliving its actor."""

from __future__ import annotations

import json
import logging
import operator
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import tensorwire
from tensorwire.cli import demo
from tensorwire.errors import AuthenticationError, ClusterError, ClusterTimeout
from tensorwire.ps import SGD, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.testing.process import wait_for

ray = pytest.importorskip("ray", reason="tensorwire.ray needs Ray: pip install 'tensorwire[ray]'")
from tensorwire.bench.peers_ray import start_ray  # noqa: E402 - Ray, once more if its first start ran out
from tensorwire.ray import Replica, run_workers, start_servers, start_stores  # noqa: E402 - needs Ray
from tensorwire.ray import __main__ as ray_main  # noqa: E402 - needs Ray

DEADLINE = 60.0
# What this 2-CPU cluster gives each: the servers mostly wait on the network, and 2 workers must
# run at once beside them.
SMALL = {"capacity": "512MiB", "cpus": 0.25, "timeout": DEADLINE, "host": "127.0.0.1"}  # servers on loopback


@pytest.fixture(scope="module", autouse=True)
def local_cluster() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no usage report, and no prompt about one
        start_ray(
            ray,
            address="local",  # a cluster of this test's own, whatever RAY_ADDRESS says
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=100 * 2**20,  # the tensors go through tensorwire, not Ray's store
            logging_level=logging.WARNING,
        )
        try:
            yield
        finally:
            ray.shutdown()


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie has: only its parent's wait is left)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(replica: Replica) -> None:
    deadline = time.monotonic() + DEADLINE
    while not gone(replica.pid):
        assert time.monotonic() < deadline, f"the server of {replica} outlived its actor"
        time.sleep(0.05)


def test_rays_workers_run_at_the_niceness_of_the_driver() -> None:
    # Ray's default, 15, starved its workers beside busy processes: a minute per actor's start.
    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=DEADLINE) == os.nice(0)


def test_the_digits_job_through_ray_servers_and_workers_reaches_the_demo_accuracy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m tensorwire.ray``, the README's one command for Ray, on this module's cluster."""
    small = ["--host", "127.0.0.1", "--capacity", "512MiB", "--server-cpus", "0.25", "--worker-cpus", "0.5"]
    short = ["--epochs", "5"]  # past the target (the demo's own test trains its full 12 epochs)
    accuracy = ray_main.main(["--slots", "2", "--workers", "2", "--timeout", "300", *short, *small])
    assert accuracy >= demo.TARGET_ACCURACY
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [url.startswith("tcp://127.0.0.1:") for url in report["servers"].split(",")] == [True, True]
    assert report["colocated"] == []
    assert report["ranks"] == [0, 1]  # each rank got its RANK; and they came back in order
    assert report["steps"] == [5 * 23, 5 * 23]  # WORLD_SIZE 2: half the rows each
    assert report["accuracy"] == round(accuracy, 4)


def steps(worker: Worker, model: torch.nn.Module, count: int) -> None:
    for step in range(count):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        worker.step()


def role(url: str) -> tuple[str, int, int]:
    (doc,) = server_stats([url], timeout=5)
    return doc["role"], doc["epoch"], doc["version"]


def test_killing_a_server_actor_fails_over_to_its_standby() -> None:
    flags = ["--failover-timeout", "0.5"]
    with start_servers(1, replicas=1, extra_args=flags, **SMALL) as servers:  # type: ignore[arg-type]
        primary, backup = servers.slots[0]
        assert servers.colocated == [0]  # one node: SPREAD could not keep them apart, and says so
        assert servers.address == f"{primary.url}|{backup.url}"
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        with Worker(model, servers.address, "async", SGD(lr=0.05), rank=0, heartbeat=0.25, timeout=30) as w:
            steps(w, model, 3)
            assert role(primary.url) == ("primary", 1, 3)
            # A backup the primary took in after the steps began holds them once its state transfer
            # is in (under make test's load that came after the third step): only then is it one
            # that may take over with nothing lost.
            wait_for(lambda: role(backup.url) == ("backup", 1, 3), DEADLINE, "the backup to hold the 3 steps")
            ray.kill(primary.actor)
            wait_gone(primary)  # the actor's death is the server's
            steps(w, model, 3)  # the worker gives up on the dead primary; the standby takes over
            assert role(backup.url) == ("primary", 2, 6)


def test_a_store_requires_its_token_and_a_killed_actor_leaves_no_server_and_no_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TENSORWIRE_TOKEN", raising=False)
    stores = start_stores(1, token="the-clients-token", **SMALL)  # type: ignore[arg-type]
    try:
        (store,) = stores.replicas
        assert psutil.Process(store.pid).is_running() and Path(store.workdir).is_dir()
        assert not list(Path(store.workdir).glob("*token*"))  # the server read its secrets at start
        with tensorwire.connect(store.url, token=stores.token) as client:
            client.put("ray/t", torch.arange(5))
        with pytest.raises(AuthenticationError):
            tensorwire.connect(store.url, retries=1, backoff=0.01)
        ray.kill(store.actor)
        wait_gone(store)
    finally:
        stores.stop()
    assert not Path(store.workdir).exists()  # swept by a task on its node


def test_a_failing_rank_is_named_and_the_environment_is_set() -> None:
    got = run_workers(os.getenv, 2, "tcp://127.0.0.1:1", args=("LOCAL_WORLD_SIZE",), cpus=0.5)
    assert got == ["2", "2"]
    with pytest.raises(ClusterError, match=r"worker rank \d of 2 failed: ZeroDivisionError") as caught:
        run_workers(operator.truediv, 2, args=(1, 0), cpus=0.5, timeout=DEADLINE)
    assert isinstance(caught.value.__cause__, ray.exceptions.RayTaskError)
    late = r"waited 1.0s for 1 workers running sleep; not done: worker rank 0 of 1"
    with pytest.raises(ClusterTimeout, match=late):
        run_workers(time.sleep, 1, args=(DEADLINE,), cpus=0.5, timeout=1.0)


def test_a_server_that_cannot_start_is_named_and_nothing_is_left() -> None:
    before = set(ray.util.placement_group_table())
    with pytest.raises(
        ClusterError, match=r"(?s)slot 0 primary failed: RuntimeError: server exited with 2.*No such option"
    ):
        start_servers(1, extra_args=["--no-such-flag"], **SMALL)  # type: ignore[arg-type]
    groups = ray.util.placement_group_table()
    assert all(groups[g]["state"] == "REMOVED" for g in set(groups) - before)
