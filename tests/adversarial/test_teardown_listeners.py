"""No peer ends the server on its other listeners either (issue 32, class 1): gRPC and memory://.

gRPC: a Get whose reader stalls is cut by the stall watchdog and a Put whose client vanishes
mid-stream is dropped, on uvloop and on plain asyncio, in a real server process that lives on and
frees what the calls held.

memory://: a client whose own event loop stopped (and closed) with a read parked on its stream
made the server's close of that stream raise (its wake-up could not be scheduled on the closed
loop); the watchdog that closed it died of it, so every later connection kept its slot for ever.
Now the wake-up of a closed loop is skipped, and the watchdog survives any one close that fails.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

import tensorwire
from tensorwire._aio import NO_UVLOOP_ENV, LoopThread, run
from tensorwire.cli.status import ask_status
from tensorwire.client import ClientOptions
from tensorwire.errors import TensorwireError
from tensorwire.server import Server
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.store import TensorStore
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.transport import memory
from tensorwire.types import Address, MiB, TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.v1 import tensor_service_pb2_grpc as pb_grpc
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.rpc import encode_chunk, info_of

BIG = torch.ones(16 * MiB)  # 64 MiB: far more than HTTP/2's windows and the socket buffers


@pytest.fixture(params=["uvloop", "asyncio"])
def grpc_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    with pytest.MonkeyPatch.context() as mp:  # the child inherits the environment
        mp.delenv(NO_UVLOOP_ENV, raising=False)
        if request.param == "asyncio":
            mp.setenv(NO_UVLOOP_ENV, "1")
        srv = ServerProcess(
            capacity="512MiB", extra=["--listen", "grpc://127.0.0.1:0", "--stall-timeout", "0.5"]
        )
    with srv:
        with tensorwire.connect(srv.url, retries=0) as c:
            c.put("big", BIG)
        yield srv


def _status(srv: ServerProcess) -> dict[str, object]:
    return run(ask_status(srv.url, ClientOptions(timeout=10.0)))


def _store(srv: ServerProcess) -> dict[str, int]:
    store = _status(srv)["store"]
    assert isinstance(store, dict)
    return store


def _stub(srv: ServerProcess) -> tuple[grpc.Channel, pb_grpc.TensorServiceStub]:
    address = Address.parse(srv.urls[1])
    channel = grpc.insecure_channel(f"{address.host}:{address.port}")
    return channel, pb_grpc.TensorServiceStub(channel)


def _alive(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None, f"the server died ({srv.proc.returncode}):\n{srv.output()[-2000:]}"
    with tensorwire.connect(srv.urls[1], retries=0, timeout=10.0) as c:  # over gRPC itself
        assert torch.equal(c.get("big"), BIG)


def test_a_stalled_grpc_get_is_cut_and_the_server_lives(grpc_server: ServerProcess) -> None:
    channel, stub = _stub(grpc_server)
    with channel:
        answers = stub.Get(pb.GetRequest(names=["big"]))
        next(answers)  # the manifest; then nothing more is read
        wait_for(lambda: "cutting off a gRPC call" in grpc_server.output(), 10, "the stalled Get to be cut")
        answers.cancel()
    wait_for(lambda: _store(grpc_server)["pinned"] == 0, 10, "the Get's pin to be released")
    _alive(grpc_server)


def test_a_grpc_put_whose_client_vanishes_is_dropped(grpc_server: ServerProcess) -> None:
    meta = TensorMeta("vanished", torch.float32, (16 * MiB,), 64 * MiB)
    piece = bytes(256 << 10)
    sent = threading.Event()

    def chunks() -> Iterator[bytes]:
        kind = int(ChecksumKind.XXH3_64)
        yield encode_chunk(piece, kind, checksum(kind, piece), tensor=info_of(meta))
        yield encode_chunk(piece, kind, checksum(kind, piece))
        sent.set()
        time.sleep(30)  # the client stops mid-stream; its channel is closed under it

    channel, _ = _stub(grpc_server)
    put = channel.stream_unary("/tensor_service.TensorService/Put", lambda b: b, pb.PutReply.FromString)
    future = put.future(chunks())
    wait_for(sent.is_set, 10, "the first chunks to go out")
    wait_for(lambda: _store(grpc_server)["reserved"] > 0, 10, "the Put's reservation")
    channel.close()  # the client vanishes with its call half sent
    future.cancel()
    wait_for(lambda: _store(grpc_server)["reserved"] == 0, 10, "the half-sent Put to be dropped")
    _alive(grpc_server)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_grpc_client_whose_server_vanishes_mid_get_raises_a_typed_error(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NO_UVLOOP_ENV, raising=False)
    if loop == "asyncio":
        monkeypatch.setenv(NO_UVLOOP_ENV, "1")  # the client's own loop (read when it is built)
    with ServerProcess(capacity="512MiB", extra=["--listen", "grpc://127.0.0.1:0"]) as srv:
        with tensorwire.connect(srv.url, retries=0) as c:
            c.put("big", BIG)

        def vanish(_: int) -> None:
            if srv.proc.poll() is None:
                srv.proc.kill()  # the server is gone in the middle of the answer

        with tensorwire.connect(srv.urls[1], retries=0, timeout=10.0) as c, pytest.raises(TensorwireError):
            c.get("big", progress=vanish)


# -- memory:// ----------------------------------------------------------------------------------


async def _until(condition: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"waited {seconds}s for {what}"
        await asyncio.sleep(0.01)


def test_a_client_loop_that_died_with_a_parked_read_does_not_end_the_watchdog() -> None:
    url = f"memory://teardown-dead-loop-{os.getpid()}"

    async def main() -> None:
        server = Server(
            ServerOptions(connections=ConnectionOptions(auth_timeout=0.3)), store=TensorStore(1 << 24)
        )
        await server.start(url)
        try:
            # A client on a loop of its own parks a read on its stream; then that loop stops and
            # closes (its owner went away without closing the stream).
            other = LoopThread("teardown-client")
            stream = other.call(memory.connect(Address.parse(url), 5.0), 5.0, "connecting")
            other.submit(stream.recv_into(memoryview(bytearray(16))))
            await _until(lambda: stream._in._waiters, 5, "the client's read to park")
            other.stop()
            # The watchdog closes the silent connection: waking a reader on a closed loop ...
            await _until(lambda: server.counts.refused.get("auth_timeout") == 1, 5, "the first close")
            # ... and goes on: the next silent connection is closed too.
            await memory.connect(Address.parse(url), 5.0)
            await _until(lambda: server.counts.refused.get("auth_timeout") == 2, 5, "the watchdog to go on")
        finally:
            await server.close()

    asyncio.run(main())
