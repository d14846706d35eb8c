"""What a peer can make the gradient exchange hold, and who it can say it is (issue 13, sweep).

* A compressed gradient declares its element count (gRPC ``numel``, ALLREDUCE records) and may
  decode to 32 times its payload: the decoded size is held against the capacity before anything
  is allocated, so a small payload cannot make the server allocate gigabytes.
* Every round and every tensor name the exchange remembers costs capacity: empty gradients under
  fresh names cannot grow its tables without bound.
* A request that is refused changes nothing: a bad gradient sent under the rank of a worker that
  has left does not make the other workers' rounds wait for that worker again.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import psutil
import pytest
import torch

from tensorwire import transport as transports
from tensorwire.compression import codec_for
from tensorwire.errors import CapacityExceeded
from tensorwire.ps import ParamServer
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.server import ServerThread
from tensorwire.testing.process import ServerProcess, run_threads
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address, TensorMeta
from tensorwire.v1 import gradient_service_pb2 as pb
from tensorwire.v1 import gradient_service_pb2_grpc as pb_grpc
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

MiB = 1 << 20


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_compressed_gradients_are_bounded_by_their_decoded_size() -> None:
    extra = ["--grpc-listen", "127.0.0.1:0"]
    with ServerProcess(capacity="64MiB", extra=extra) as srv:
        before = psutil.Process(srv.pid).memory_info().rss
        # gRPC: 40 KB of top-k payload that says it is 50 million elements (200 MB decoded).
        numel = 50_000_000
        payload = bytes(codec_for("topk:0.0001").payload_bytes(numel))
        metadata = [("worker-id", "0"), ("step", "0"), ("tensor-name", "w"), ("world-size", "1"),
                    ("codec", "topk:0.0001"), ("numel", str(numel))]  # fmt: skip
        with grpc.insecure_channel(srv.urls[1].removeprefix("grpc://")) as channel:
            stub = pb_grpc.GradientServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.UpdateGradient(pb.GradientRequest(gradient=payload), metadata=metadata, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--capacity" in (refused.value.details() or "")
        # ALLREDUCE: a 32 MiB sign payload of a 1 GiB float32 tensor, under a 64 MiB capacity.
        with pytest.raises(CapacityExceeded, match="--capacity"):
            asyncio.run(sign_allreduce(Address.parse(srv.url), 1 << 28))
        grown = peak_rss(srv.pid) - before
        assert grown < 96 * MiB, f"refused gradients raised the server's peak memory by {grown >> 20} MiB"


async def sign_allreduce(address: Address, numel: int) -> None:
    options = transports.TransportOptions(5.0, 30.0)
    conn = await transports.open_transport(address, options)
    assert isinstance(conn, FramedTransport)
    try:
        meta = TensorMeta("w", torch.float32, (numel,), 4 * numel)
        body = wps.PsHead(0, 1, 0, 0, 10_000).encode() + wm.encode_records([meta]) + wps.encode_codec("sign")
        payload = memoryview(bytearray(codec_for("sign").payload_bytes(numel)))

        def sink(metas: list[TensorMeta]) -> list[memoryview]:
            raise AssertionError(f"the server averaged {metas}")

        await conn.call(Opcode.ALLREDUCE, body, [payload], sink, what="a sign-coded allreduce")
    finally:
        await conn.close()


def test_fresh_tensor_names_cost_capacity() -> None:
    """Empty gradients of one-worker rounds, each under a new name: the names the exchange
    remembers as averaged are paid for, so a 64 KiB exchange stops taking new ones."""
    with ServerThread(["grpc://127.0.0.1:0"], extensions=[ParamServer(capacity=64 << 10)]) as srv:
        target = srv.url.removeprefix("grpc://")
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GradientServiceStub(channel)
            accepted = 0
            with pytest.raises(grpc.RpcError) as full:
                for i in range(2000):
                    metadata = [
                        ("worker-id", "0"),
                        ("step", "0"),
                        ("tensor-name", f"n{i}"),
                        ("world-size", "1"),
                    ]
                    stub.UpdateGradient(pb.GradientRequest(gradient=b""), metadata=metadata, timeout=10)
                    accepted += 1
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 100 < accepted < 400, accepted


def test_a_refused_gradient_does_not_rejoin_the_rank_it_claims() -> None:
    with ServerThread(
        ["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], extensions=[ParamServer(wait_timeout=30, workers=3)]
    ) as srv:
        url, target = str(srv.addresses[0]), str(srv.addresses[1]).removeprefix("grpc://")
        ExchangeClient(url, rank=2, world_size=3).close()  # rank 2 is done: rounds go on without it
        got: dict[int, list[float]] = {}

        def send(rank: int, grad: torch.Tensor) -> list[float]:
            metadata = [("worker-id", str(rank)), ("step", "0"), ("tensor-name", "w"), ("world-size", "3")]
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.GradientServiceStub(channel)
                request = pb.GradientRequest(gradient=grad.numpy().tobytes())
                reply = stub.UpdateGradient(request, metadata=metadata, timeout=8)
            return torch.frombuffer(bytearray(reply.updated_gradient), dtype=torch.float32).tolist()

        def worker(rank: int) -> None:
            if rank == 1:  # after rank 0's gradient is in and the impostor was refused
                wait_until_round_open(srv)
                with pytest.raises(grpc.RpcError) as bad:
                    send(2, torch.ones(8))  # rank 2's name, the wrong shape: refused
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            got[rank] = send(rank, torch.full((4,), float(rank + 1)))

        run_threads(worker, 2, timeout=30)
    assert got == {0: [1.5] * 4, 1: [1.5] * 4}


def wait_until_round_open(srv: ServerThread) -> None:
    from tensorwire.testing.process import wait_for

    # a ParamServer adds the relay coordinator beside itself (ps.Worker(pull="relay"))
    (ps,) = [e for e in srv.server.extensions if isinstance(e, ParamServer)]
    wait_for(lambda: ps.exchange._rounds, 10, "rank 0's gradient to open its round")
