"""rdma:// under faults: a server killed mid-transfer, a client killed holding registered buffers,
and transfers that land other bytes or too few. Real processes where a process dies; every wait
is on an event or a condition polled with a deadline, and every process started is ended."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire import ServerThread
from tensorwire.errors import CorruptFrame, TensorwireError
from tensorwire.server.rdma import RdmaService
from tensorwire.testing import rdma as kit
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.transport import rdma_engine

pytestmark = pytest.mark.skipif(
    kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"
)
BIG = 64 << 20


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


def _service(srv: ServerThread) -> RdmaService:
    return next(e for e in srv.server.extensions if isinstance(e, RdmaService))


@pytest.mark.parametrize("op", ["write", "read"])
def test_server_killed_mid_transfer_fails_the_client_within_its_timeout(
    monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """The server dies while the client holds a reservation (a put's buffer, a get's copy) and its
    engine is about to move the bytes: the call fails with a tensorwire error within its timeout."""
    started = threading.Event()
    release = threading.Event()
    real = getattr(rdma_engine.Engine, op)

    async def held(self: rdma_engine.Engine, *args: object, **kw: object) -> None:
        started.set()  # the request holds its reservation: the server dies now
        assert release.wait(30), "the test never let the transfer go on"
        await real(self, *args, **kw)

    timeout = 10.0
    with ServerProcess("rdma://127.0.0.1:0") as server:
        client = tensorwire.connect(server.url, timeout=timeout, retries=1)
        tensor = torch.ones(BIG, dtype=torch.uint8)
        if op == "read":
            client.put("big", tensor)
        monkeypatch.setattr(rdma_engine.Engine, op, held)
        errors: list[BaseException] = []

        def call() -> None:
            try:
                client.put("big", tensor) if op == "write" else client.get(
                    "big", out=torch.empty_like(tensor)
                )
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        assert started.wait(30), "the call never reached the engine"
        server.signal(signal.SIGKILL)
        server.proc.wait(10)
        began = time.monotonic()
        release.set()
        worker.join(timeout * 3)
        assert not worker.is_alive(), "the call did not fail within its timeout"
        assert time.monotonic() - began < timeout * 3
        assert errors and isinstance(errors[0], TensorwireError), errors
        client.close()


_HOLDER = """
import sys, torch, tensorwire
from tensorwire._aio import run
from tensorwire.transport import TransportOptions, open_channel
from tensorwire.wire import meta as wm
from tensorwire.wire import rdma as wr
from tensorwire.wire.frame import Opcode
from tensorwire.types import TensorMeta

async def hold():
    channel = await open_channel(sys.argv[1], TransportOptions(5.0, 5.0), what="holder")
    metas = [TensorMeta(f"t{i}", torch.uint8, (1 << 20,), 1 << 20) for i in range(3)]
    await channel.call(Opcode.RDMA_PUT, wm.encode_records(metas), what="RDMA_PUT")
    get = wr.encode_get_request(1 << 20, ["kept"])
    await channel.call(Opcode.RDMA_GET, get, sink=lambda m: [], what="get")
    print("held", flush=True)
    sys.stdin.readline()  # until killed

run(hold())
"""


@pytest.fixture
def holder_process() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_client_killed_holding_registered_buffers_frees_them(
    holder_process: list[subprocess.Popen[str]],
) -> None:
    with ServerThread(["rdma://127.0.0.1:0"]) as srv:
        with tensorwire.connect(srv.url) as client:
            client.put("kept", torch.ones(1 << 18))
        service = _service(srv)
        command = [sys.executable, "-c", _HOLDER, srv.url]
        env = {**os.environ, **kit.TCP_MODE}
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        holder_process.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child prints once it holds; it dies with the test otherwise
        assert line.strip() == "held", line
        assert len(service.engine.registered) == 4 and srv.server.store.reserved > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(
            lambda: not service.engine.registered and srv.server.store.reserved == 0 and service.open == 0,
            10.0, "the server to free what the killed client held",
        )  # fmt: skip
        assert srv.server.store.stat(["kept"])[0].nbytes == 1 << 20


def _lying_write(kind: str) -> object:
    real_write = rdma_engine.Engine.write

    async def write(
        self: rdma_engine.Engine, session: str, local: int, remote: int, length: int, *, timeout: float,
        keep: object = None,
    ) -> None:  # fmt: skip
        if kind == "short":  # a transfer that stops half way
            await real_write(self, session, local, remote, length // 2, timeout=timeout, keep=keep)
            return
        junk = torch.full((length,), 0x5A, dtype=torch.uint8)  # a write that lands other bytes
        self.register(junk.data_ptr(), length)
        try:
            await real_write(self, session, junk.data_ptr(), remote, length, timeout=timeout, keep=junk)
        finally:
            self.unregister(junk.data_ptr())

    return write


@pytest.mark.parametrize("kind", ["short", "other-bytes"])
def test_a_corrupt_or_short_put_is_caught_and_nothing_stored(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    with ServerThread(["rdma://127.0.0.1:0"]) as srv, tensorwire.connect(srv.url, retries=0) as client:
        monkeypatch.setattr(rdma_engine.Engine, "write", _lying_write(kind))
        with pytest.raises(CorruptFrame, match="nothing stored"):
            client.put("x", torch.full((1 << 20,), 7, dtype=torch.uint8))
        assert client.list() == []
        assert srv.server.store.reserved == 0 and not _service(srv).engine.registered


def test_a_corrupt_get_is_caught_and_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    real_read = rdma_engine.Engine.read
    damaged: list[int] = []

    async def read(
        self: rdma_engine.Engine, session: str, local: int, remote: int, length: int, *, timeout: float,
        keep: object = None,
    ) -> None:  # fmt: skip
        await real_read(self, session, local, remote, length, timeout=timeout, keep=keep)
        if not damaged:  # the first read lands a flipped byte
            damaged.append(local)
            byte = ctypes.c_uint8.from_address(local + length // 2)
            byte.value ^= 0xFF

    tensor = torch.randn(1 << 18)
    with ServerThread(["rdma://127.0.0.1:0"]) as srv:
        with tensorwire.connect(srv.url) as client:
            client.put("x", tensor)
            monkeypatch.setattr(rdma_engine.Engine, "read", read)
            assert torch.equal(client.get("x"), tensor)  # the client's retry read it again
            assert damaged
        with tensorwire.connect(srv.url, retries=0) as client:
            damaged.clear()
            with pytest.raises(CorruptFrame, match="fails its checksum"):
                client.get("x")
