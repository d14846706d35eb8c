"""One server that stops answering must not cost a worker its place on the others.

A worker beats to every server on a connection of its own; a beat to a server that is stopped
(SIGSTOP: its port still accepts, nothing answers) waits out the beat's timeout. When the beats
went out as one round (gather, then sleep), each round waited for that timeout, so the healthy
servers heard from the worker only every timeout + interval, past their heartbeat timeout, and
dropped it: in the etcd chaos run both workers were dropped by the slot that was never faulted
and spent seconds rejoining. Each server has a beat loop of its own now.
"""

from __future__ import annotations

import time

import ps_job
import torch

from tensorwire.ps import Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.testing.faults import sigcont, sigstop
from tensorwire.testing.process import ServerProcess, wait_for

HEARTBEAT_TIMEOUT = 1.0
PAUSE = 4.0  # the stopped server's silence: four heartbeat timeouts


def test_a_stopped_server_does_not_make_the_others_drop_the_worker() -> None:
    flags = ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
    with ServerProcess(extra=flags) as stopped, ServerProcess(extra=flags) as healthy:
        servers = [stopped.url, healthy.url]
        model = ps_job.model()
        with Worker(model, servers, "async", rank=0, heartbeat=0.25, timeout=30) as worker:
            assert all(slot.shards for slot in worker._slots), "the model must live on both servers"

            def live_on_healthy() -> bool:
                return bool(server_stats([healthy.url])[0]["workers"]["0"]["live"])

            wait_for(live_on_healthy, 10, "the worker to join the healthy server")
            sigstop(stopped.proc)()
            try:
                until = time.monotonic() + PAUSE
                while time.monotonic() < until:  # the fault's length, checked all along
                    (doc,) = server_stats([healthy.url])
                    assert doc["workers_dropped"] == 0, "the healthy server dropped the worker"
                    time.sleep(0.05)
            finally:
                sigcont(stopped.proc)()
            # The stopped one dropped it as it woke (silent for PAUSE s): the next step rejoins there.
            x, y = ps_job.batch(0, 0)
            torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            worker.step()
            assert all(doc["workers"]["0"]["live"] for doc in server_stats(servers))
        assert server_stats([healthy.url])[0]["workers_dropped"] == 0
