"""The gradient exchange over TCP (ExchangeClient) and over gRPC (a client generated from
train.GradientService), on real loopback servers, in the same rounds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
import torch

from tensorwire.errors import ProtocolError, TransferTimeout
from tensorwire.ps import ParamServer
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads
from tensorwire.v1 import gradient_service_pb2 as pb
from tensorwire.v1 import gradient_service_pb2_grpc as pb_grpc

N = 3


@contextlib.contextmanager
def exchange_server(workers: int = 0, wait_timeout: float = 30.0) -> Iterator[tuple[str, str]]:
    """One server: (its tcp:// URL, its gRPC host:port)."""
    with ServerThread(
        ["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], extensions=[ParamServer(wait_timeout, workers)]
    ) as server:
        tcp, rpc = (str(a) for a in server.addresses)
        yield tcp, rpc.removeprefix("grpc://")


def grads_of(rank: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return {"fc.weight": torch.randn(64, 32, generator=gen), "fc.bias": torch.randn(64, generator=gen)}


def expected_mean(step: int, ranks: range) -> dict[str, torch.Tensor]:
    every = [grads_of(r, step) for r in ranks]
    return {
        name: sum(g[name] for g in every[1:]) / len(every) + every[0][name] / len(every) for name in every[0]
    }


def test_tcp_allreduce_gives_every_worker_the_same_mean() -> None:
    results: dict[int, list[dict[str, torch.Tensor]]] = {}
    with exchange_server() as (url, _):

        def work(rank: int) -> None:
            with ExchangeClient(url, rank=rank, world_size=N) as client:
                results[rank] = []
                for step in range(3):
                    grads = grads_of(rank, step)
                    assert client.allreduce(grads) == N  # in place
                    results[rank].append(grads)

        run_threads(work, N, 60)
    for step in range(3):
        want = expected_mean(step, range(N))
        for rank in range(N):
            for name, value in want.items():
                assert torch.allclose(results[rank][step][name], value, atol=1e-6)
                assert torch.equal(results[rank][step][name], results[0][step][name])  # bit-identical


def test_grpc_generated_client_takes_part_in_the_same_rounds() -> None:
    """Ranks 0 and 1 speak gRPC through the generated stub, rank 2 speaks TCP: one mean for all."""
    got: dict[int, torch.Tensor] = {}
    with exchange_server() as (url, target):

        def work(rank: int) -> None:
            grad = grads_of(rank, 0)["fc.bias"]
            if rank == 2:
                with ExchangeClient(url, rank=rank, world_size=N) as client:
                    client.allreduce({"fc.bias": grad})
                got[rank] = grad
                return
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.GradientServiceStub(channel)
                metadata = [("worker-id", str(rank)), ("step", "0"), ("tensor-name", "fc.bias"),
                            ("world-size", str(N))]  # fmt: skip
                request = pb.GradientRequest(gradient=grad.numpy().tobytes())
                reply = stub.UpdateGradient(request, metadata=metadata, timeout=30)
                got[rank] = torch.frombuffer(bytearray(reply.updated_gradient), dtype=torch.float32)

        run_threads(work, N, 60)
    want = expected_mean(0, range(N))["fc.bias"]
    for rank in range(N):
        assert torch.allclose(got[rank], want, atol=1e-6)


def test_grpc_errors_name_what_is_wrong() -> None:
    with (
        exchange_server(workers=2, wait_timeout=0.5) as (_, target),
        grpc.insecure_channel(target) as channel,
    ):
        stub = pb_grpc.GradientServiceStub(channel)
        request = pb.GradientRequest(gradient=torch.ones(4).numpy().tobytes())
        with pytest.raises(grpc.RpcError) as missing:
            stub.UpdateGradient(request, metadata=[("worker-id", "0")], timeout=10)
        assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "step, tensor-name" in (missing.value.details() or "")
        with pytest.raises(grpc.RpcError) as ragged:
            ragged_request = pb.GradientRequest(gradient=b"\x00" * 6)
            stub.UpdateGradient(ragged_request, metadata=[("worker-id", "0"), ("step", "0"),
                                                          ("tensor-name", "w")], timeout=10)  # fmt: skip
        assert ragged.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as alone:  # the server's --workers 2: worker 1 never comes
            stub.UpdateGradient(request, metadata=[("worker-id", "0"), ("step", "0"),
                                                   ("tensor-name", "w")], timeout=10)  # fmt: skip
        assert alone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "from worker(s) 1" in (alone.value.details() or "")


def test_a_worker_that_leaves_is_not_waited_for() -> None:
    """Uneven data: rank 0 has 2 steps, rank 1 has 5; rank 1's last rounds average over itself."""
    counts: dict[int, list[int]] = {0: [], 1: []}
    with exchange_server() as (url, _):

        def work(rank: int) -> None:
            with ExchangeClient(url, rank=rank, world_size=2, timeout=20) as client:
                for step in range(2 if rank == 0 else 5):
                    counts[rank].append(client.allreduce(grads_of(rank, step)))

        run_threads(work, 2, timeout=60)
    assert counts[0] == [2, 2]
    assert counts[1][:2] == [2, 2] and counts[1][2:] == [1, 1, 1]


def test_tcp_allreduce_timeout_and_bad_input() -> None:
    with exchange_server() as (url, _):
        lonely = ExchangeClient(url, rank=0, world_size=2, timeout=0.5)
        with (
            lonely,
            pytest.raises(TransferTimeout, match=r"step 0 of 'fc\.(weight|bias)' from worker\(s\) 1"),
        ):
            lonely.allreduce(grads_of(0, 0))
        with ExchangeClient(url, rank=0, world_size=1) as client:
            assert client.allreduce(grads_of(0, 0)) == 1  # the timed-out round left nothing behind
            with pytest.raises(ProtocolError, match="already averaged"):
                client.step = 0  # a replay of a step that is done
                client.allreduce(grads_of(0, 0))
            assert client.allreduce({"x": torch.ones(3)}) == 1  # the connection still serves


def test_a_second_run_on_the_same_server_starts_again_at_step_0() -> None:
    with exchange_server() as (url, _):
        for run in range(2):
            counts: dict[int, int] = {}

            def work(rank: int, run: int = run, counts: dict[int, int] = counts) -> None:
                with ExchangeClient(url, rank=rank, world_size=2) as client:
                    counts[rank] = client.allreduce({"w": torch.full((3,), float(rank + run))})

            run_threads(work, 2, 60)
            assert counts == {0: 2, 1: 2}, f"run {run}"
