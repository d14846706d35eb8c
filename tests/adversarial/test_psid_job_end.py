"""A job ends only when every rank has left for good. A worker dropped for missed heartbeats
(a stalled or restarting process, a loaded machine) has not left: when the other workers then
leave, the job and its updates must stay for it to rejoin. Ending it there freed the state, and
the dropped worker's rejoin started a fresh job at step 0 (the chaos benchmark's failover then
waited on a worker that never joined it)."""

from __future__ import annotations

import asyncio
import json

import torch

from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread
from tensorwire.testing.process import wait_for


def linear() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Linear(8, 3)


def test_a_dropped_workers_job_outlives_the_others_leaving() -> None:
    with ServerThread(extensions=[ParamServer(30, heartbeat_timeout=0.5)]) as server:
        url = server.url
        stalled = Worker(linear(), url, "async", SGD(lr=0.1), rank=1, world_size=2, heartbeat=0, job="j")
        stalled.start()  # joins, then sends no heartbeat: it looks like a stalled process
        with Worker(linear(), url, "async", SGD(lr=0.1), rank=0, world_size=2, heartbeat=0.1, job="j") as w:
            net = w.model
            net(torch.ones(2, 8)).sum().backward()  # type: ignore[no-untyped-call]
            w.step()
            stats = lambda: server_stats([url])[0]  # noqa: E731
            wait_for(lambda: not stats()["workers"]["1"]["live"], 10, "worker 1 to be dropped")
        # Worker 0 left for good; worker 1 was only dropped: the job and its update stay.
        (after,) = server_stats([url])
        assert list(after["jobs"]) == ["j"] and after["version"] == 1, after["jobs"]
        stalled.close()  # its leave, the last one for good: now the job ends
        (ended,) = server_stats([url])
        assert ended["jobs"] == {} and ended["ended"][-1]["job"] == "j"


def test_a_state_transfer_carries_who_left_for_good() -> None:
    """A backup taking over ends the job as its primary would have: the state transfer says which
    workers left for good (else a job whose workers all left, one before a failover and the last
    after it, would never end by itself)."""
    with ServerThread(extensions=[primary := ParamServer(30)]) as server:
        url = server.url
        with Worker(linear(), url, "async", SGD(lr=0.1), rank=1, world_size=2, heartbeat=0, job="j"):
            pass  # joined and left for good
        with Worker(linear(), url, "async", SGD(lr=0.1), rank=0, world_size=2, heartbeat=0, job="j"):
            state, tensors = primary.jobs.take_all()  # worker 0 live, worker 1 gone for good
    backup = ParamServer(30)
    asyncio.run(backup.jobs.load_all(json.loads(json.dumps(state)), tensors))  # as on the wire: JSON
    run = backup.job("j")
    assert run is not None
    assert run.members.workers[1].finished and not run.members.workers[0].finished
    assert not run.members.finished()  # worker 0 has not left yet
