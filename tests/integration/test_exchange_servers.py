"""The gradient exchange over several servers (ExchangeClient with many URLs): tensors cut into
pieces larger than one request, spread over real loopback servers, averaged exactly; a server that
stops fails the step naming it; a gRPC client built from the same ``split`` joins the same rounds."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from tensorwire.errors import ConnectionLost, TensorwireError
from tensorwire.ps import ParamServer
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.ps.exchange.pieces import split
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads
from tensorwire.v1 import gradient_service_pb2 as pb
from tensorwire.v1 import gradient_service_pb2_grpc as pb_grpc

PIECE = 4096  # bytes: every tensor below but the small ones is cut into several pieces
SHAPES = {
    "fc1.weight": (torch.float32, (64, 100)),
    "fc1.bias": (torch.float32, (10,)),
    "fc2.weight": (torch.float64, (3000,)),
    "fc2.bias": (torch.bfloat16, (5000,)),
    "unused": (torch.float32, (0,)),
}


@contextlib.contextmanager
def servers(count: int, wait_timeout: float = 30.0) -> Iterator[list[ServerThread]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                ServerThread(
                    ["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], extensions=[ParamServer(wait_timeout, 0)]
                )
            )
            for _ in range(count)
        ]


def grads(rank: int, step: int, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = SHAPES
          ) -> dict[str, torch.Tensor]:  # fmt: skip
    """Small integers, different per rank and step: the mean of two is exact in every dtype."""
    out = {}
    for i, (name, (dtype, shape)) in enumerate(shapes.items()):
        n = 1
        for d in shape:
            n *= d
        out[name] = ((torch.arange(n) * (i + 1) + step) % 64 + 2 * rank).to(dtype).view(shape)
    return out


def mean(step: int) -> dict[str, torch.Tensor]:
    a, b = grads(0, step), grads(1, step)
    return {name: (a[name].double() + b[name].double()).div(2).to(a[name].dtype) for name in a}


@pytest.mark.parametrize(("count", "lanes", "as_string"), [(2, 1, False), (3, 2, True), (1, 2, False)])
def test_two_workers_get_the_exact_mean_over_several_servers(count: int, lanes: int, as_string: bool) -> None:
    results: dict[int, list[dict[str, torch.Tensor]]] = {0: [], 1: []}
    sent: dict[int, int] = {}
    with servers(count) as srvs:
        urls = [s.url for s in srvs]

        def work(rank: int) -> None:
            where = ",".join(urls) if as_string else urls
            with ExchangeClient(where, rank=rank, world_size=2, lanes=lanes, piece_bytes=PIECE) as client:
                assert client.address == client.addresses[0] and len(client.addresses) == count
                for step in range(2):
                    g = grads(rank, step)
                    assert client.allreduce(g) == 2
                    results[rank].append(g)
                sent[rank] = client.bytes_sent
                assert client.bytes_received == client.bytes_sent

        run_threads(work, 2, 60)
        rounds = [s.server.extensions[0].exchange.rounds_done for s in srvs]  # type: ignore[attr-defined]
    total = sum(t.numel() * t.element_size() for t in grads(0, 0).values())
    assert sent == {0: 2 * total, 1: 2 * total}  # each byte once per step, uncompressed
    assert all(r > 0 for r in rounds), rounds  # every server averaged some of the pieces
    for step in range(2):
        for name, want in mean(step).items():
            for rank in (0, 1):
                got = results[rank][step][name]
                assert got.dtype == want.dtype and torch.equal(got, want), (step, name, rank)


def test_a_codec_with_error_feedback_over_two_servers() -> None:
    """fp16 on the wire (lossy, so error feedback is on): the values are exact in fp16, so the mean
    is exact, the residuals (one per piece, under the piece's name) stay zero, half the bytes go."""
    shapes = {"w": (torch.float32, (3000,)), "b": (torch.float32, (7,))}
    results: dict[int, dict[str, torch.Tensor]] = {}
    with servers(2) as srvs:
        urls = [s.url for s in srvs]

        def work(rank: int) -> None:
            with ExchangeClient(urls, rank=rank, world_size=2, codec="fp16", piece_bytes=PIECE) as client:
                assert client.feedback is not None
                g = grads(rank, 0, shapes)
                assert client.allreduce(g) == 2
                results[rank] = g
                assert client.bytes_sent == sum(t.numel() * 2 for t in g.values())
                residuals = client.feedback.residuals
                assert "b" in residuals and "w#0:1024" in residuals and len(residuals) == 4
                assert all(not r.any() for r in residuals.values())

        run_threads(work, 2, 60)
    a, b = grads(0, 0, shapes), grads(1, 0, shapes)
    for name in shapes:
        want = (a[name] + b[name]) / 2
        assert torch.equal(results[0][name], want) and torch.equal(results[1][name], want)


def test_a_server_that_stops_fails_the_step_naming_it() -> None:
    """Between steps: both workers' next step fails at once, naming the stopped server; their
    tensors are not to be used (the module doc), here a mix of their own values and the mean."""
    timeout = 5.0
    errors: dict[int, BaseException] = {}
    after: dict[int, dict[str, torch.Tensor]] = {}
    stopped = threading.Barrier(2)
    with servers(2) as (live, doomed):
        doomed_url = doomed.url  # a closed server forgets its addresses

        def work(rank: int) -> None:
            client = ExchangeClient([live.url, doomed_url], rank=rank, world_size=2, timeout=timeout,
                                    piece_bytes=PIECE)  # fmt: skip
            with client:
                assert client.allreduce(grads(rank, 0)) == 2
                if stopped.wait(30) == 0:  # one of the two stops it, then both go on
                    doomed.close()
                stopped.wait(30)
                g = grads(rank, 1)
                start = time.monotonic()
                with pytest.raises(TensorwireError) as failed:
                    client.allreduce(g)
                assert time.monotonic() - start < timeout
                errors[rank], after[rank] = failed.value, g

        with pytest.raises(TensorwireError, match=doomed_url):  # leaving the stopped server fails too
            run_threads(work, 2, 60)
    for rank in (0, 1):
        assert doomed_url in str(errors[rank]), errors[rank]
    want = mean(1)
    for rank in (0, 1):  # each element its own value or, where the live server answered first, the mean
        own = grads(rank, 1)
        for name, got in after[rank].items():
            assert bool(((got == own[name]) | (got == want[name])).all()), (rank, name)


def test_a_server_that_stops_mid_step_fails_it_within_the_timeout() -> None:
    """Worker 0 alone sent its step (worker 1 never comes): while its requests wait on both servers,
    one server stops. The error is that server's, raised at once, not the live server's timeout
    later; closing leaves the live server on a new connection (the step's was dropped)."""
    timeout = 3.0
    with servers(2, wait_timeout=timeout) as (live, doomed):
        exchange = doomed.server.extensions[0].exchange  # type: ignore[attr-defined]
        doomed_url = doomed.url  # a closed server forgets its addresses
        client = ExchangeClient(
            [live.url, doomed_url], rank=0, world_size=2, timeout=timeout, piece_bytes=PIECE
        )

        def stop_when_waiting() -> None:
            deadline = time.monotonic() + 30
            while exchange.held == 0 and time.monotonic() < deadline:  # a round open on it
                time.sleep(0.01)
            doomed.close()

        stopper = threading.Thread(target=stop_when_waiting)
        stopper.start()
        start = time.monotonic()
        try:
            with pytest.raises(TensorwireError, match=doomed_url) as failed:
                client.allreduce(grads(0, 0))
            assert time.monotonic() - start < timeout  # not the live server's WaitTimeout
            assert isinstance(failed.value, ConnectionLost)
        finally:
            stopper.join(30)
            with pytest.raises(TensorwireError, match=doomed_url) as leaving:
                client.close()
            assert not getattr(leaving.value, "__notes__", None)  # only the stopped server failed
            assert live.server.extensions[0].exchange.left == {0}  # type: ignore[attr-defined]
        with pytest.raises(TensorwireError, match="closed"):
            client.allreduce(grads(0, 1))


def test_a_server_that_is_down_fails_the_constructor_naming_it() -> None:
    with servers(2) as (up, down):
        down_url = down.url
        down.close()
        with pytest.raises(TensorwireError, match=down_url):
            ExchangeClient([up.url, down_url], rank=0, world_size=1, connect_timeout=5)
        with pytest.raises(ValueError, match="server URLs"):
            ExchangeClient("", rank=0, world_size=1)
        with pytest.raises(ValueError, match="lanes"):
            ExchangeClient(up.url, rank=0, world_size=1, lanes=0)


def test_grpc_and_tcp_clients_share_the_rounds_of_several_servers() -> None:
    """Rank 0 speaks gRPC through the generated stub, one UpdateGradient per piece of the same
    ``split`` to the server it belongs to; rank 1 speaks tcp through ExchangeClient."""
    shapes = {"w": (torch.float32, (3000,)), "b": (torch.float32, (7,))}
    layout = [(n, d, s) for n, (d, s) in shapes.items()]
    got: dict[int, dict[str, torch.Tensor]] = {}
    with servers(2) as srvs:
        urls = [s.url for s in srvs]
        targets = [str(s.addresses[1]).removeprefix("grpc://") for s in srvs]

        def work(rank: int) -> None:
            g = grads(rank, 0, shapes)
            if rank == 1:
                with ExchangeClient(urls, rank=1, world_size=2, piece_bytes=PIECE) as client:
                    client.allreduce(g)
            else:
                channels = [grpc.insecure_channel(t) for t in targets]
                stubs = [pb_grpc.GradientServiceStub(c) for c in channels]  # type: ignore[no-untyped-call]
                flats = [t.view(-1) for t in g.values()]
                for piece in split(layout, len(targets), PIECE):
                    view = flats[piece.tensor][piece.start : piece.stop]
                    metadata = [
                        ("worker-id", "0"),
                        ("step", "0"),
                        ("tensor-name", piece.name),
                        ("world-size", "2"),
                    ]
                    request = pb.GradientRequest(gradient=view.numpy().tobytes())
                    reply = stubs[piece.server].UpdateGradient(request, metadata=metadata, timeout=30)
                    view.copy_(torch.frombuffer(bytearray(reply.updated_gradient), dtype=torch.float32))
                for channel in channels:
                    channel.close()
            got[rank] = g

        run_threads(work, 2, 60)
    a, b = grads(0, 0, shapes), grads(1, 0, shapes)
    for name in shapes:
        want = (a[name] + b[name]) / 2
        assert torch.equal(got[0][name], want) and torch.equal(got[1][name], want), name


def test_nothing_to_average_and_a_closed_client() -> None:
    with servers(2) as srvs:
        client = ExchangeClient([s.url for s in srvs], rank=0, world_size=1, piece_bytes=PIECE)
        with client:
            assert client.allreduce({}) == 1
            g = grads(0, 0)
            assert client.allreduce(g) == 1 and torch.equal(g["fc1.weight"], grads(0, 0)["fc1.weight"])
        client.close()  # a second close does nothing
        with pytest.raises(TensorwireError, match="closed"):
            client.allreduce(g)
