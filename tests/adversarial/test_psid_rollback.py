"""PS_ROLLBACK moves a job to an older checkpoint, dropping every step after it: only a worker of
the job may ask, from the session that joined with its rank, once it stepped aside. Before, any
client the server admitted could roll a job back while none of its workers was live (between a
restart and the workers' rejoin, or after they stepped aside), losing acknowledged steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from psid_kit import call

from tensorwire.errors import ProtocolError, WorkerDropped
from tensorwire.ps import SGD, CheckpointPolicy, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode


def steps(net: torch.nn.Module, worker: Worker, count: int) -> None:
    for _ in range(count):
        net(torch.ones(2, 8)).pow(2).mean().backward()  # type: ignore[no-untyped-call]
        worker.step()


def rollback(url: str, job: str, version: int, *, worker: int, incarnation: int) -> None:
    call(url, Opcode.PS_ROLLBACK, wps.PsHead(worker, 1, version, incarnation, job=job).encode())


def test_only_the_worker_that_stepped_aside_rolls_its_job_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    policy = CheckpointPolicy(tmp_path, every_steps=2)
    with (
        ServerThread(extensions=[ParamServer(checkpoints=policy, keep_jobs=True)]) as server,
        Worker(net, [server.url], "sync", SGD(lr=0.1), rank=0, world_size=1, heartbeat=0) as worker,
    ):
        steps(net, worker, 6)  # checkpoints of versions 2, 4 and 6
        job, incarnation = worker.job, worker.incarnation
        slot = worker._slots[0]
        worker._loop().call(slot.rpc.leave(slot.clock, incarnation, final=False), 10, "stepping aside")
        # No worker is live now. A client that is not the worker: refused, the job unchanged.
        with pytest.raises(ProtocolError, match="never joined"):
            rollback(server.url, job, 2, worker=3, incarnation=incarnation)
        with pytest.raises(WorkerDropped, match="belongs to another session"):
            rollback(server.url, job, 2, worker=0, incarnation=incarnation ^ 1)
        with pytest.raises(ProtocolError, match="carries no incarnation"):
            rollback(server.url, job, 2, worker=0, incarnation=0)
        (stats,) = server_stats([server.url], job=job)
        assert stats["version"] == 6 and stats["identity_refused"] == 2
        # The worker itself, from its own session: rolled back.
        rollback(server.url, job, 4, worker=0, incarnation=incarnation)
        (stats,) = server_stats([server.url], job=job)
        assert stats["version"] == 4
