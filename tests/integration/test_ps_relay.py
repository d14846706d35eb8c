"""Parameter-server pulls through the relay (``ps.Worker(pull="relay")``): the same bits as direct
pulls, each version leaving the server about once, and a fallback that is never silent."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.testing.process import ServerProcess, run_threads

JOB = Path(__file__).parent.parent / "fault" / "ps_job.py"  # the fault tests' worker script
_SPEC = importlib.util.spec_from_file_location("ps_job", JOB)
assert _SPEC is not None and _SPEC.loader is not None
ps_job = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ps_job)
DEADLINE = 90.0
STEPS, WORLD = 15, 3


def start(server: str, job: str, pull: str, out: Path) -> list[subprocess.Popen[bytes]]:
    out.mkdir()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "TENSORWIRE_JOB": job}
        cmd = [sys.executable, str(JOB), server, "sync", str(STEPS), str(out), pull]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def finish(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Exit codes; every process still running after the deadline is killed (and fails the test)."""
    try:
        return [proc.wait(DEADLINE) for proc in procs]
    finally:
        for proc in filter(lambda p: p.poll() is None, procs):
            proc.kill()
            proc.wait()


def state(out: Path, rank: int) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(out / f"rank{rank}.pt", weights_only=True)
    return loaded


def test_relay_pulls_train_bit_for_bit_as_direct_ones_sending_each_version_once(tmp_path: Path) -> None:
    """A sync job of three worker processes pulling through the relay ends with the bits of the
    same job pulling directly (threads, in this process); the server sent each version's
    parameters about once (direct: once per worker)."""
    direct = tmp_path / "direct"
    direct.mkdir()
    with ServerThread(extensions=[ParamServer()]) as reference:
        train = lambda r: ps_job.train(reference.url, "sync", STEPS, direct, rank=r, world=WORLD)  # noqa: E731
        run_threads(train, WORLD, 60)
    with ServerProcess() as server:
        assert finish(start(server.url, "relay", "relay", tmp_path / "relay")) == [0] * WORLD
        (stats,) = server_stats([server.url])
    expected = state(direct, 0)
    for rank in range(WORLD):
        got = state(tmp_path / "relay", rank)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), rank
    param_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    versions = STEPS + 1  # the first pull, then one per step
    served = stats["relay"]["served_bytes"]["relay"]
    print(f"relay: the server sent {served / (versions * param_bytes):.2f}x the parameters per version")
    assert versions * param_bytes <= served <= 1.5 * versions * param_bytes
    assert stats["relay"]["published"] == versions
    reports = [(tmp_path / "relay" / f"rank{r}.json").read_text() for r in range(WORLD)]
    assert all('"relay_fallbacks": 0' in r for r in reports), reports


def small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 2)


def test_a_server_that_cannot_publish_falls_back_to_direct_pulls_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store too small for a published copy of the parameters: every pull falls back, logged and
    counted, and training goes on as with direct pulls. Its capacity, the process's one, holds the
    job (72 bytes of parameters, gradients and pull copies: a few hundred bytes), not a publish
    (each published tensor also costs 1 KiB of names)."""
    models = [small() for _ in range(2)]
    with ServerThread(store=TensorStore(capacity=1024), extensions=[ParamServer(30.0)]) as server:
        results: dict[int, tuple[int, int]] = {}

        def work(rank: int) -> None:
            model = models[rank]
            with Worker(model, server.url, "sync", SGD(lr=0.1), rank=rank, world_size=2, pull="relay",
                        timeout=30) as worker:  # fmt: skip
                for step in range(3):
                    F.mse_loss(model(torch.ones(4, 8) * (step + rank)), torch.zeros(4, 2)).backward()
                    worker.step()
                assert worker.relay is not None
                results[rank] = worker.relay.pulls, worker.relay.fallbacks

        with caplog.at_level(logging.WARNING, "tensorwire.ps.worker"):
            run_threads(work, 2, 60)
    assert results == {0: (0, 4), 1: (0, 4)}  # the first pull and one per step, each fallen back
    assert any("relay pull falls back" in r.getMessage() for r in caplog.records)
    assert torch.equal(models[0].weight, models[1].weight)


@pytest.mark.parametrize(
    ("servers", "options", "says"),
    [
        ("tcp://127.0.0.1:1", {"pull_codec": "int8"}, "pull_codec"),
        ("memory://relay-test", {}, "tcp:// or tls://"),
        ("tcp://127.0.0.1:1|memory://relay-test", {}, "tcp:// or tls://"),
        ("tcp://127.0.0.1:1", {"pull": "broadcast"}, "'direct' or 'relay'"),
    ],
)
def test_what_cannot_go_through_the_relay_is_refused_when_the_worker_is_made(
    servers: str, options: dict[str, str], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        Worker(small(), servers, "sync", **{"pull": "relay", **options})  # type: ignore[arg-type]


def test_relay_pulls_from_a_server_that_also_serves_shared_memory_relay_between_the_workers() -> None:
    """A server on tcp:// and shm:// (one host): the workers' slots speak shm:// (prefer_local), but
    each worker joins the relay over its own tcp:// connection, naming its session, and relays."""
    models = [small() for _ in range(2)]
    urls = ["tcp://127.0.0.1:0", "shm://127.0.0.1:0"]
    with ServerThread(urls, extensions=[ParamServer(30.0)]) as server:
        results: dict[int, tuple[int, int]] = {}

        def work(rank: int) -> None:
            model = models[rank]
            with Worker(model, server.url, "sync", SGD(lr=0.1), rank=rank, world_size=2, pull="relay",
                        timeout=30) as worker:  # fmt: skip
                assert worker.relay is not None
                for step in range(3):
                    F.mse_loss(model(torch.ones(4, 8) * (step + rank)), torch.zeros(4, 2)).backward()
                    worker.step()
                results[rank] = worker.relay.pulls, worker.relay.fallbacks

        run_threads(work, 2, 60)
        relay = server.server.status()["relay"]
    assert results == {0: (4, 0), 1: (4, 0)}  # the first pull and one per step, none fallen back
    assert relay["unadmitted"] == 0  # both were registered: strung into the job's chain
    assert torch.equal(models[0].weight, models[1].weight)
