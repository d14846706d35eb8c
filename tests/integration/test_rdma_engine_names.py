"""A transfer engine names a peer only ``host:rpc_port`` and keeps what it learned of it by that
name for its whole life, while the port is drawn at random from a small range (Mooncake's
15000-17000). So a server restarted on the same host can come back under the name of an engine
this process reached before; a client engine that wrote to it would write to the dead engine's
data port (the transfer fails, rc -1, every time). Each server engine therefore says which
engine it is (RDMA_ATTACH's instance), and a client reaches a new engine by an old name through a
fresh client engine. And a closed engine frees its ports, or a long-lived process would hold one
pair per server it ever ran."""

from __future__ import annotations

import logging

import psutil
import pytest
import torch

import tensorwire
from tensorwire import ServerThread
from tensorwire.server.rdma import RdmaService
from tensorwire.testing import rdma as kit
from tensorwire.transport import rdma_clients, rdma_engine

pytestmark = pytest.mark.skipif(
    kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"
)
HOST = "127.0.0.1"


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


def _engine_of(srv: ServerThread) -> rdma_engine.Engine:
    return next(e for e in srv.server.extensions if isinstance(e, RdmaService)).engine


def _round_trip(client: tensorwire.Client, name: str) -> None:
    data = torch.randn(1 << 18)  # 1 MiB: through the engine both ways
    client.put(name, data)
    out = torch.empty_like(data)
    client.get(name, out=out)
    assert torch.equal(out, data)


def _listening(session: str) -> bool:
    """Whether anything listens on the engine's handshake port still (its peers' connections to it
    may linger a while after it closed: they are not what holds the port)."""
    port = int(session.rpartition(":")[2])
    listeners = psutil.Process().net_connections("tcp")
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in listeners)


def test_a_new_engine_under_a_known_name_is_reached_by_a_fresh_client_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with ServerThread(["rdma://127.0.0.1:0"]) as srv:
        server_engine = _engine_of(srv)
        with tensorwire.connect(srv.url) as first:
            _round_trip(first, "a")
            old = rdma_clients.client_engines.current(HOST)
            assert old is not None and not old.closed
            with tensorwire.connect(srv.url) as same:  # the same engine: the same client engine
                _round_trip(same, "b")
                assert rdma_clients.client_engines.current(HOST) is old
            # What a restarted server whose engine drew the old one's port looks like from here.
            server_engine.instance ^= 1
            with caplog.at_level(logging.WARNING, "tensorwire.rdma"), tensorwire.connect(srv.url) as second:
                _round_trip(second, "c")
                fresh = rdma_clients.client_engines.current(HOST)
                assert fresh is not None and fresh is not old
                assert "restarted" in caplog.text
                assert not old.closed  # `first` still moves bytes through it
                _round_trip(first, "d")
    assert old.closed  # its last connection let it go
    assert not _listening(old.session)
    assert not fresh.closed  # the current one stays for the next connection


def test_a_stopped_server_frees_its_engine_ports() -> None:
    with ServerThread(["rdma://127.0.0.1:0"]) as srv:
        with tensorwire.connect(srv.url) as client:
            _round_trip(client, "x")
        session = _engine_of(srv).session
        assert _listening(session)
    assert not _listening(session)  # `srv` still holds the server and its engine object
