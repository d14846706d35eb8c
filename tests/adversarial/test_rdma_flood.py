"""rdma://: a flood of connections to the transfer engine's own ports (issue 32, classes 12 and 3).

The engine library accepts every connection to its handshake and data ports and keeps it until the
peer closes it, unauthenticated and outside ``--max-connections``: each is a descriptor of the
server process, and the handshake port serves one connection at a time. So a peer that opens
hundreds of silent (or one-byte) connections could run the process out of descriptors (the other
clients' persisted puts then fail with EMFILE) and hold up every new client's handshake. The
server bounds them: a connection that sends nothing within a second is shut down, and beyond
``--max-connections`` the most idle ones are; both are counted in
``tensorwire_connections_refused_total`` and logged. A real ``tensorwire serve`` process, raw
sockets, and a real rdma:// client (TCP mode)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import urllib.request
from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire import Server, TensorStore
from tensorwire._aio import run
from tensorwire.client.batches import TensorBatch
from tensorwire.client.core import ClientOptions
from tensorwire.dashboard.collect import ask_status
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.server.rdma import RdmaService
from tensorwire.testing import rdma as kit
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.transport import TransportOptions, open_channel
from tensorwire.transport.rdma import RdmaTransport

pytestmark = pytest.mark.skipif(
    kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"
)
BOUND = 16  # --max-connections
LISTEN = "0A"


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


def _engine_side(pid: int, ports: set[int]) -> int:
    """Connections the server process holds on its engine's ports (descriptors it has accepted)."""
    inodes = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    held = 0
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                parts = row.split()
                port = int(parts[1].rpartition(":")[2], 16)
                held += port in ports and parts[3] != LISTEN and int(parts[9]) in inodes
    return held


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def _flood(ports: list[int], per_port: int, first: bytes) -> Iterator[list[socket.socket]]:
    """``per_port`` connections to each port, each sending ``first`` (maybe nothing) and then
    nothing more, held open while the block runs."""
    socks: list[socket.socket] = []
    try:
        for port in ports:
            for _ in range(per_port):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                if first:
                    sock.sendall(first)
                socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _refused(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as page:
        text = page.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith('tensorwire_connections_refused_total{reason="rdma_'):
            reason = line.split('"')[1]
            found[reason] = float(line.rsplit(" ", 1)[1])
    return found


def test_a_flood_of_connections_to_the_engine_ports_holds_bounded_descriptors() -> None:
    """300 connections to the data port (half silent, half with one byte of a request head: not
    silent, so only the bound applies) and 40 silent ones to the handshake port: the server's
    engine-side connections come down to the bound, its descriptors with them, the refusals are
    counted, and a client that first connects during the flood still moves tensors."""
    extra = ["--listen", "tcp://127.0.0.1:0", "--max-connections", str(BOUND), "--metrics-port", "0"]
    with ServerProcess("rdma://127.0.0.1:0", capacity="256MiB", extra=extra) as srv:
        rdma_url = next(u for u in srv.urls if u.startswith("rdma://"))
        tcp_url = next(u for u in srv.urls if u.startswith("tcp://"))
        status = run(ask_status(tcp_url, ClientOptions()))
        rpc = int(status["rdma"]["session"].rpartition(":")[2])
        ports = {p["port"] for p in status["rdma"]["ports"]}
        (data,) = ports - {rpc}
        before = _descriptors(srv.pid)
        with _flood([data], 150, b""), _flood([data], 150, b"\x01"), _flood([rpc], 40, b""):
            bounded = lambda: _engine_side(srv.pid, ports) <= BOUND + 1  # noqa: E731 (+1: the handshake in service)
            wait_for(bounded, 15.0, "the engine's connections to come down to the bound")
            assert _descriptors(srv.pid) <= before + BOUND + 4
            with tensorwire.connect(rdma_url) as client:  # its engine's handshake is behind the flood
                x = torch.arange(1 << 20, dtype=torch.float32)
                client.put("x", x)
                assert torch.equal(client.get("x"), x)
            assert bounded()
        refused = _refused(status["metrics"])
        assert refused.get("rdma_limit", 0) >= 1 and refused.get("rdma_silent", 0) >= 1, refused
        assert "beyond its bound of 16 connections (--max-connections)" in srv.output()


def test_a_clients_idle_engine_connections_are_not_cut() -> None:
    """The guard cuts what sends nothing, not what went quiet: a client's engine connections stay
    open well past the grace (they sent their requests), and its next transfer needs no retry."""

    async def case() -> None:
        server = Server(
            ServerOptions(connections=ConnectionOptions(auth_timeout=0.2, max_connections=BOUND)),
            store=TensorStore(1 << 28),
        )  # grace 0.2 s
        await server.start("rdma://127.0.0.1:0")
        service = next(e for e in server.extensions if isinstance(e, RdmaService))
        engine = service.engine
        channel = await open_channel(server.addresses[0], TransportOptions(5.0, 5.0), what="the test")
        try:
            assert isinstance(channel, RdmaTransport)
            data = torch.randn(1 << 18)
            await channel.put(TensorBatch([("w", data)]))
            held = {s.inode for s in engine.sockets.connections(engine.sockets.ports)}
            assert held
            await asyncio.sleep(1.0)  # not synchronisation: idle for 5 x the grace, 2 sweeps at least
            assert {s.inode for s in engine.sockets.connections(engine.sockets.ports)} >= held
            out = torch.empty_like(data)
            await channel.get(["w"], lambda metas: [out.numpy().data.cast("B")])
            assert torch.equal(out, data)
            assert server.status()["rdma"]["peers"] == {"bound": BOUND, "shut": {"silent": 0, "limit": 0}}
        finally:
            await channel.close()
            await server.close()

    run(case())
