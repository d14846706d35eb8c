"""Servers restored from checkpoints of different steps are rolled back to the older one by the
worker that rejoins them (it joined them first, so it leaves the ones ahead before it asks: a
server rolls back only with no worker live). Before, the rollback was refused ("cannot roll back
while workers [0] are live") and the worker failed whenever a kill left its servers' newest
checkpoints a step interval apart."""

from __future__ import annotations

import shutil
from pathlib import Path

import ps_job
import torch

from tensorwire.ps import SGD, CheckpointPolicy, ParamServer, Worker
from tensorwire.server import ServerThread


def train(model: torch.nn.Module, urls: list[str], first: int, steps: int) -> None:
    with Worker(model, urls, "sync", SGD(lr=0.05), rank=0, world_size=1, heartbeat=0) as worker:
        for step in range(first, first + steps):
            x, y = ps_job.batch(0, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            worker.step()


def test_servers_restored_a_checkpoint_apart_are_rolled_back_to_one_step(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    policies = [CheckpointPolicy(d, every_steps=5) for d in dirs]
    model = ps_job.model()
    # The servers keep the job when its worker leaves (as after a crash of the servers).
    servers = [ServerThread(extensions=[ParamServer(checkpoints=p, keep_jobs=True)]) for p in policies]
    with servers[0], servers[1]:
        train(model, [s.url for s in servers], 0, 10)
    # Server b lost its newest checkpoints (killed before it wrote them): it comes back at step 5.
    (job_directory,) = dirs[1].iterdir()  # <checkpoint dir>/<job id>
    for newest in sorted(job_directory.iterdir())[1:]:
        shutil.rmtree(newest)
    restored = [ParamServer(checkpoints=p) for p in policies]
    assert [r.restore(p.directory) for r, p in zip(restored, policies, strict=True)] == [True, True]
    assert [r.step for r in restored] == [10, 5]
    with ServerThread(extensions=[restored[0]]) as a, ServerThread(extensions=[restored[1]]) as b:
        train(model, [a.url, b.url], 5, 3)
        assert restored[0].step == restored[1].step == 8
