"""What a parameter server keeps per push and per pull counts against its capacity, and payloads
that no encoder writes are refused before they reach the parameters."""

from __future__ import annotations

import secrets

import pytest
import torch
from psid_kit import config, init, join, pull, push

from tensorwire.compression import codec_for
from tensorwire.errors import CapacityExceeded, InvalidTensor, LimitExceeded
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread

N = 1 << 16  # elements of the job's one shard: 256 KiB
KEY = f"w#0:{N}"


def test_pending_sync_pushes_are_counted_against_the_capacity() -> None:
    """Six ranks of a sync job each push a step's gradients: the server holds every set until the
    step. With room for the parameters and three sets, the fourth is refused, naming --capacity."""
    world, nbytes = 6, 4 * N
    ps = ParamServer(capacity=4 * nbytes)
    sessions = [secrets.randbits(63) or 1 for _ in range(world)]
    with ServerThread(extensions=[ps]) as server:
        for rank, incarnation in enumerate(sessions):
            join(server.url, rank, world, incarnation)
        init(server.url, 0, world, config("sync"), {KEY: torch.zeros(N)}, incarnation=sessions[0])
        grads = {KEY: torch.ones(N)}
        for rank in range(3):
            push(server.url, grads, worker=rank, world=world, incarnation=sessions[rank])
        with pytest.raises(CapacityExceeded, match="--capacity"):
            push(server.url, grads, worker=3, world=world, incarnation=sessions[3])
        (stats,) = server_stats([server.url])
        assert sum(stats["held_bytes"].values()) <= stats["capacity"] == 4 * nbytes
        assert stats["workers"]["3"]["seq"] == 0  # the refused push changed nothing


def test_pulls_keep_one_version_in_a_bounded_number_of_codecs() -> None:
    """Codec names are a peer's choice (``int8:1``, ``int8:2``, ...): each would be another copy of
    the parameters. A bounded number per version is kept, each counted; readers outside the job
    (observers) add at most one of their own, so they cannot take the workers' codecs."""
    ps = ParamServer()
    net = torch.nn.Linear(64, 64)
    with (
        ServerThread(extensions=[ps]) as server,
        Worker(net, [server.url], "async", SGD(), rank=0, world_size=1, heartbeat=0) as worker,
    ):
        keys = [s.key for s in worker.placement.on_server(0)]
        me = worker.incarnation
        for chunk in range(1, 5):
            pull(server.url, 0, keys, me, codec=f"int8:{chunk}", job=worker.job)
        with pytest.raises(LimitExceeded, match="at most 4 codecs"):
            pull(server.url, 0, keys, me, codec="int8:5", job=worker.job)
        pull(server.url, 0xFFFFFFFF, keys, 0, codec="int8:2", job=worker.job)  # shares the workers'
        pull(server.url, 0xFFFFFFFF, keys, 0, codec="fp16", job=worker.job)  # its own one
        with pytest.raises(LimitExceeded, match=r"observers' pulls .* at most 1 codecs"):
            pull(server.url, 0xFFFFFFFF, keys, 0, codec="bf16", job=worker.job)
        held = server_stats([server.url])[0]["held_bytes"]["snapshots"]
        assert held >= 5 * sum(s.numel for s in worker.placement.on_server(0))  # the encodings count


def hostile_payloads() -> dict[str, tuple[str, torch.Tensor]]:
    """Payloads of N elements that decode without an error on a server that trusts them."""
    int8 = codec_for("int8").encode(torch.ones(N))
    int8[:4].view(torch.float32)[0] = float("nan")  # the first chunk's scale
    sign = codec_for("sign").encode(torch.ones(N))
    sign[:4].view(torch.float32)[0] = float("inf")
    topk = codec_for("topk:0.5").encode(torch.arange(N, dtype=torch.float32))
    topk[4:8] = topk[:4]  # the second index is the first one again
    return {"int8": ("int8", int8), "sign": ("sign", sign), "topk": ("topk:0.5", topk)}


@pytest.mark.parametrize("kind", ["int8", "sign", "topk"])
def test_a_push_whose_payload_no_encoder_writes_changes_nothing(kind: str) -> None:
    codec, payload = hostile_payloads()[kind]
    ps = ParamServer()
    with ServerThread(extensions=[ps]) as server:
        session = secrets.randbits(63) or 1
        join(server.url, 0, 1, session)
        init(server.url, 0, 1, config("async", lr=0.1), {KEY: torch.ones(N)}, incarnation=session)
        with pytest.raises(InvalidTensor):
            push(server.url, {KEY: torch.empty(N)}, incarnation=session, codec=codec, payloads=[payload])
        assert ps.version == 0 and ps.workers[0].seq == 0
        assert torch.equal(ps.shards[KEY].param.detach(), torch.ones(N))
        # The same session's next (good) push is push 1, and is applied.
        push(server.url, {KEY: torch.ones(N)}, incarnation=session)
        assert ps.version == 1 and bool(torch.isfinite(ps.shards[KEY].param).all())
