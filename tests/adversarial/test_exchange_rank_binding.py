"""The gradient exchange binds a rank to the client that sends under it: another client cannot
send a gradient, or a leave, under that rank (issue 13: identity before side effects).

Before, a forged ALLREDUCE under rank 1 joined the step's round in the real rank 1's place (its
gradient went into everyone's mean, and the real worker's was then refused as a second one), and
a forged PS_LEAVE made the rounds stop waiting for rank 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
import torch

from tensorwire.errors import ProtocolError
from tensorwire.ps import ParamServer
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads
from tensorwire.v1 import gradient_service_pb2 as pb
from tensorwire.v1 import gradient_service_pb2_grpc as pb_grpc


@contextlib.contextmanager
def exchange(wait_timeout: float = 30.0) -> Iterator[tuple[ServerThread, ParamServer]]:
    ps = ParamServer(wait_timeout, workers=2)
    with ServerThread(["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], extensions=[ps]) as server:
        yield server, ps


def grad(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((16,), value)}


def both_step(clients: list[ExchangeClient], values: tuple[float, float]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]

    def work(rank: int) -> None:
        tensors = grad(values[rank])
        assert clients[rank].allreduce(tensors) == 2
        out[rank] = tensors["w"]

    run_threads(work, 2, 60)
    return out


def test_a_forged_allreduce_under_a_bound_rank_is_refused_and_the_real_worker_goes_on() -> None:
    with exchange() as (server, ps):
        url = server.url
        with ExchangeClient(url, rank=0, world_size=2) as a, ExchangeClient(url, rank=1, world_size=2) as b:
            both_step([a, b], (1.0, 3.0))  # step 0: both ranks now belong to a and b
            forger = ExchangeClient(url, rank=1, world_size=2, timeout=5)
            forger.step = 1
            try:
                with pytest.raises(ProtocolError, match="belongs to another client"):
                    forger.allreduce(grad(1000.0))
            finally:
                forger._thread.stop()  # not close(): its leave would be refused too
            means = both_step([a, b], (2.0, 4.0))  # step 1: the real rank 1 is not "a second gradient"
        assert all(torch.equal(m, torch.full((16,), 3.0)) for m in means)
        assert ps.exchange.identity_refused >= 1


def test_a_forged_leave_does_not_release_the_real_worker() -> None:
    with exchange() as (server, _):
        url = server.url
        with ExchangeClient(url, rank=0, world_size=2) as a, ExchangeClient(url, rank=1, world_size=2) as b:
            both_step([a, b], (1.0, 3.0))
            forger = ExchangeClient(url, rank=1, world_size=2, timeout=5)
            with pytest.raises(ProtocolError, match="belongs to another client"):
                forger.close()
            means = both_step([a, b], (2.0, 6.0))  # rank 0 still waits for rank 1's real gradient
        assert all(torch.equal(m, torch.full((16,), 4.0)) for m in means)


def test_a_grpc_call_under_a_rank_a_frame_client_holds_is_refused() -> None:
    with exchange() as (server, _):
        url, rpc = server.url, str(server.addresses[1]).removeprefix("grpc://")
        with ExchangeClient(url, rank=0, world_size=2) as a, ExchangeClient(url, rank=1, world_size=2) as b:
            both_step([a, b], (1.0, 3.0))
            metadata = (("worker-id", "1"), ("step", "1"), ("tensor-name", "w"), ("world-size", "2"))
            request = pb.GradientRequest(gradient=torch.full((16,), 9.0).numpy().tobytes())
            with grpc.insecure_channel(rpc) as channel:
                stub = pb_grpc.GradientServiceStub(channel)
                with pytest.raises(grpc.RpcError) as info:
                    stub.UpdateGradient(request, metadata=metadata, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "belongs to another client" in (info.value.details() or "")
            means = both_step([a, b], (2.0, 4.0))
        assert all(torch.equal(m, torch.full((16,), 3.0)) for m in means)


def test_grpc_callers_with_sessions_keep_their_ranks_across_channels() -> None:
    """Rank 1's session holds the rank on a new channel (a reconnect); another session may not."""
    with exchange() as (server, _):
        url, rpc = server.url, str(server.addresses[1]).removeprefix("grpc://")

        def call(session: str, step: int, value: float) -> torch.Tensor:
            metadata = (("worker-id", "1"), ("step", str(step)), ("tensor-name", "w"),
                        ("world-size", "2"), ("session", session))  # fmt: skip
            request = pb.GradientRequest(gradient=torch.full((16,), value).numpy().tobytes())
            with grpc.insecure_channel(rpc) as channel:  # a new connection each time
                reply = pb_grpc.GradientServiceStub(channel).UpdateGradient(
                    request, metadata=metadata, timeout=20
                )
            return torch.frombuffer(bytearray(reply.updated_gradient), dtype=torch.float32)

        with ExchangeClient(url, rank=0, world_size=2) as a:

            def step(step: int, values: tuple[float, float]) -> list[torch.Tensor]:
                """Rank 0 over the frame protocol and rank 1 (session "rank-one") over gRPC."""
                means = [torch.empty(0), torch.empty(0)]

                def work(index: int) -> None:
                    if index == 0:
                        tensors = grad(values[0])
                        a.allreduce(tensors)
                        means[0] = tensors["w"]
                    else:
                        means[1] = call("rank-one", step, values[1])

                run_threads(work, 2, 60)
                return means

            assert torch.equal(step(0, (1.0, 3.0))[1], torch.full((16,), 2.0))
            with pytest.raises(grpc.RpcError) as info:
                call("someone-else", 1, 100.0)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            means = step(1, (5.0, 7.0))
        assert torch.equal(means[0], torch.full((16,), 6.0)) and torch.equal(means[1], means[0])
