"""``connect(url, prefer_local=True)``: a tcp:// client of a server on this host that serves shm://
moves to it (HELLO says where the server runs and where its shm:// listener is), and says so; in
every other case it stays on tcp://, and where shm:// was tried and failed it says why, never
silently (a warning, ``local_fallback``, ``LOCAL_FALLBACKS``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorwire import aconnect, connect, topology
from tensorwire import transport as transports
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.types import MiB
from tensorwire.wire import shm as ws

BOTH = ["tcp://127.0.0.1:0", "shm://127.0.0.1:0"]


@pytest.fixture
def both() -> Iterator[ServerThread]:
    with ServerThread(
        BOTH, ServerOptions(location=topology.Location("h1", "r1")), store=TensorStore(64 * MiB)
    ) as srv:
        yield srv


def round_trip(url: str, **options: object) -> str:
    """Put and get a large tensor (in a segment over shm://) and a small one; the transport used."""
    big, small = torch.randn(1 << 17), torch.arange(10)
    with connect(url, **options) as c:
        c.put("big", big)
        c.put("small", small)
        assert torch.equal(c.get("big"), big)
        assert torch.equal(c.get("small"), small)
        assert c.local_fallback is None
        return c.transport


def test_a_local_server_serving_shm_is_reached_through_it(both: ServerThread) -> None:
    assert both.url.startswith("tcp://")
    assert round_trip(both.url, prefer_local=True) == "shm"
    assert round_trip(both.url) == "tcp"  # prefer_local is off by default


def test_hello_says_where_the_server_runs(both: ServerThread) -> None:
    with connect(both.url) as c:
        where = c._async._transport.info.where  # type: ignore[union-attr]
    assert where is not None
    assert (where.host, where.rack) == ("h1", "r1")
    assert where.shm == str(both.addresses[1])
    assert where.host_id == topology.host_identity(ws.shm_dir())
    status = both.server.status()
    assert (status["host"], status["rack"]) == ("h1", "r1")


def test_the_async_client_moves_too(both: ServerThread) -> None:
    async def main() -> str:
        client = await aconnect(both.url, prefer_local=True)
        try:
            await client.put("x", torch.ones(1 << 16))
            assert torch.equal(await client.get("x"), torch.ones(1 << 16))
            return client.transport
        finally:
            await client.close()

    assert asyncio.run(main()) == "shm"


def test_a_server_without_shm_keeps_tcp() -> None:
    with ServerThread(["tcp://127.0.0.1:0"]) as srv:
        assert round_trip(srv.url, prefer_local=True) == "tcp"


def test_a_server_on_another_host_keeps_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(topology.HOST_ENV, "another-host")  # the server's identity: not this client's
    with ServerThread(BOTH) as srv:
        monkeypatch.delenv(topology.HOST_ENV)
        assert round_trip(srv.url, prefer_local=True) == "tcp"
        assert transports.LOCAL_FALLBACKS[srv.url] == 0  # nothing was tried: nothing fell back


def test_a_failed_shm_attach_keeps_tcp_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Same identity (as two containers that claim one host), but the server's segments are out of
    # the client's sight: SHM_ATTACH cannot find the probe.
    monkeypatch.setenv(topology.HOST_ID_ENV, "one-host")
    monkeypatch.setenv(ws.SHM_DIR_ENV, str(tmp_path / "server"))
    (tmp_path / "server").mkdir()
    (tmp_path / "client").mkdir()
    with ServerThread(BOTH) as srv:
        monkeypatch.setenv(ws.SHM_DIR_ENV, str(tmp_path / "client"))
        caplog.set_level(logging.WARNING, "tensorwire.transport")
        with connect(srv.url, prefer_local=True) as c:
            assert c.transport == "tcp"
            assert c.local_fallback is not None and "SharedMemoryUnavailable" in c.local_fallback
            c.put("t", torch.ones(4))
            assert torch.equal(c.get("t"), torch.ones(4))
        assert transports.LOCAL_FALLBACKS[srv.url] == 1
        assert "shared memory unavailable" in caplog.text


@pytest.mark.parametrize("prefer_local", [True, False])
def test_a_ps_worker_reaches_a_local_server_through_shm(prefer_local: bool) -> None:
    from tensorwire.ps import SGD, ParamServer, Worker

    model = torch.nn.Linear(4, 2)
    with (
        ServerThread(BOTH, extensions=[ParamServer(30.0)]) as srv,
        Worker(model, [srv.url], "sync", SGD(lr=0.1), rank=0, world_size=1, prefer_local=prefer_local) as w,
    ):
        model(torch.ones(3, 4)).sum().backward()
        w.step()
        conn = w._slots[0].conn
        assert conn is not None and conn.address.scheme == ("shm" if prefer_local else "tcp")
