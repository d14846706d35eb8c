"""A worker that names a job but runs another one (model, mode, optimizer, world) is refused at its
join, naming the difference, and leaves no trace; a worker of the same job still rejoins. A
job's configuration, sent by a peer, is checked completely before it becomes the job's."""

from __future__ import annotations

import json

import pytest
import torch
from psid_kit import init

from tensorwire.errors import ProtocolError
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread


class Layer(torch.nn.Module):
    """A linear layer whose weight is (rows, cols): the same elements either way round."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols))
        self.bias = torch.nn.Parameter(torch.zeros(4))


def refused(url: str, net: torch.nn.Module, match: str, **options: object) -> None:
    settings: dict[str, object] = {"mode": "sync", "optimizer": SGD(lr=0.1), "world_size": 2, "job": "run-17"}
    settings.update(options)
    late = Worker(net, [url], rank=1, timeout=5, heartbeat=0, **settings)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=match):
        late.start()


def test_another_job_under_a_jobs_id_is_refused_naming_what_differs_and_leaves_no_trace() -> None:
    ps = ParamServer()
    with (
        ServerThread(extensions=[ps]) as server,
        Worker(
            Layer(4, 8), [server.url], "sync", SGD(lr=0.1), rank=0, world_size=2, heartbeat=0, job="run-17"
        ),
    ):
        # The same elements in another shape: the shards match, the model does not.
        refused(server.url, Layer(8, 4), r"model's parameters \(names, shapes or dtypes\) differ")
        refused(server.url, Layer(4, 8), "optimizer lr 0.1 here, 0.2 asked", optimizer=SGD(lr=0.2))
        refused(server.url, Layer(4, 8), "mode sync here, async asked", mode="async")
        refused(server.url, Layer(4, 8), "world has 3 workers; it has 2", world_size=3)
        refused(server.url, torch.nn.Linear(8, 5), "not in this job")
        (stats,) = server_stats([server.url])
        assert list(stats["workers"]) == ["0"]  # no refused worker was ever admitted
        assert stats["jobs_refused"] == 4  # (the world size is refused before the job is compared)
        assert list(stats["jobs"]) == ["run-17"]  # nor was a job opened for any of them
        # A worker of the same job joins (and leaves) as before.
        with Worker(Layer(4, 8), [server.url], "sync", SGD(lr=0.1), rank=1, world_size=2, heartbeat=0,
                    job="run-17"):  # fmt: skip
            assert server_stats([server.url])[0]["workers"]["1"]["live"]


BAD_CONFIGS = {
    "an infinite lr": {"mode": "async", "optimizer": {"kind": "sgd", "lr": 1e999}},
    "a NaN momentum": {"mode": "async", "optimizer": {"kind": "sgd", "momentum": float("nan")}},
    "momentum above 1": {"mode": "async", "optimizer": {"kind": "sgd", "momentum": 5}},
    "a boolean lr": {"mode": "async", "optimizer": {"kind": "sgd", "lr": True}},
    "three betas": {"mode": "async", "optimizer": {"kind": "adam", "betas": [0.9, 0.9, 0.9]}},
    "a string flag": {"mode": "async", "optimizer": {"kind": "adam", "amsgrad": "yes"}},
    "an unknown key": {"mode": "async", "optimizer": {"kind": "sgd"}, "shards": 9},
    "a huge ssp bound": {"mode": "ssp:99999999999999999999", "optimizer": {"kind": "sgd"}},
    "a unicode ssp bound": {"mode": "ssp:\u0663", "optimizer": {"kind": "sgd"}},
    "a mode that is a list": {"mode": ["sync"], "optimizer": {"kind": "sgd"}},
}


@pytest.mark.parametrize("why", list(BAD_CONFIGS))
def test_a_bad_configuration_from_a_peer_never_becomes_the_job(why: str) -> None:
    ps = ParamServer()
    with ServerThread(extensions=[ps]) as server:
        with pytest.raises(ProtocolError, match="unusable parameter-server config"):
            init(server.url, 0, 1, json.dumps(BAD_CONFIGS[why]), {"w#0:4": torch.zeros(4)})
        assert ps.config is None and not ps.shards


def test_a_deeply_nested_configuration_is_a_protocol_error() -> None:
    ps = ParamServer()
    with ServerThread(extensions=[ps]) as server:
        bomb = '{"mode": ' + "[" * 30000 + "]" * 30000 + ', "optimizer": {"kind": "sgd"}}'
        with pytest.raises(ProtocolError, match="unusable parameter-server config"):
            init(server.url, 0, 1, bomb, {"w#0:4": torch.zeros(4)})
        assert ps.config is None
