"""Parameter-server pulls through the relay (``pull="relay"``): only the job's own live workers are
strung into its chains. An observer pulling through the relay, or any other connection joining the
job's relay prefix, reads from the server, unregistered, so it is never upstream of a worker and
cannot make the workers' pulls wait (docs/protocol.md §13.2, §15.3)."""

from __future__ import annotations

import torch

from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.job import relay_prefix
from tensorwire.server import ServerThread
from tensorwire.testing.relay import RelayConn


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def step(net: torch.nn.Module, worker: Worker) -> None:
    net(torch.ones(2, 8)).pow(2).mean().backward()
    worker.step()


def test_readers_outside_the_job_are_never_upstream_of_its_workers() -> None:
    net = model()
    with (
        ServerThread(extensions=[ParamServer()]) as server,
        Worker(
            net, [server.url], "async", SGD(lr=0.1), rank=0, world_size=1, heartbeat=0, pull="relay"
        ) as worker,  # fmt: skip
    ):
        assert worker.relay is not None
        chains = RelayCoordinator.of(server.server).chains
        prefix = relay_prefix(worker.job)
        step(net, worker)
        assert worker.relay.pulls >= 1 and worker.relay.fallbacks == 0
        assert chains.readers_by_prefix()[prefix] == 1  # the worker: its PS_RELAY admitted it

        with RelayConn(server.url) as stranger:  # joins the job's relay with an address to serve
            _, placed = stranger.join("tcp://127.0.0.1:7000", prefix=prefix)
            assert placed.reader == 0 and placed.upstream == 0  # from the server; nobody's upstream
        with Worker(model(), [server.url], rank=0, world_size=1, heartbeat=0, observer=True,
                    pull="relay", job=worker.job) as observer:  # fmt: skip
            assert observer.relay is not None and observer.relay.pulls == 1  # it read, unregistered
        assert chains.readers_by_prefix()[prefix] == 1
        assert server.server.status()["relay"]["unadmitted"] == 2

        step(net, worker)
        assert worker.relay.fallbacks == 0
