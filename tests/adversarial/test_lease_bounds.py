"""Leases on generations (docs/protocol.md §14, "Leases"; issue 32, classes 2 and 4): a lease names
a generation by its number ("latest" would move under it, and could then be neither released nor
counted), ends with its connection, is released only by the connection that took it, and one
client host holds at most ``--leases-per-client`` of them whatever number of connections (or gRPC
peers) it opens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
import torch

import tensorwire
from tensorwire import transport
from tensorwire.errors import InvalidTensor, LimitExceeded, ProtocolError
from tensorwire.server.options import ServerOptions
from tensorwire.store.generations import GenerationConfig
from tensorwire.testing.process import wait_for
from tensorwire.transport import TransportOptions
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire import generations as wg
from tensorwire.wire.frame import Opcode
from tensorwire.wire.rpc import SERVICE


@pytest.fixture
def srv() -> Iterator[tensorwire.ServerThread]:
    config = GenerationConfig(keep=1, leases_per_owner=2, leases_per_client=3)
    with tensorwire.ServerThread(
        ["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], ServerOptions(generations=config)
    ) as server:
        yield server


def _leased(srv: tensorwire.ServerThread, prefix: str) -> dict[int, int]:
    """Generation number -> how many leases hold it."""
    entry = srv.server.generations._prefixes[prefix]
    return {number: len(kept.leases) for number, kept in entry.kept.items() if kept.leases}


async def _raw_lease(url: str, prefix: str, number: int, ms: int) -> None:
    """GEN_LEASE as any peer may send it, on a connection of its own (closed after)."""
    channel = await transport.open_channel(url, TransportOptions(10.0, 10.0), what="a raw lease")
    try:
        await channel.call(Opcode.GEN_LEASE, wg.encode_lease(prefix, number, ms), what="lease")
    finally:
        await channel.close()


def test_a_lease_on_latest_is_refused_and_none_outlives_its_connection(srv: tensorwire.ServerThread) -> None:
    with tensorwire.connect(srv.url) as c:
        c.publish("p", {"x": torch.zeros(2)})
    for ms in (30_000, 0):  # a lease on "latest", and its release
        with pytest.raises(ProtocolError, match="not 'latest'"):
            asyncio.run(_raw_lease(srv.url, "p", wg.LATEST, ms))
    wait_for(lambda: srv.server.generations.leases == 0, 10, "no lease left once the connection closed")
    assert _leased(srv, "p") == {}
    with tensorwire.connect(srv.url) as c:
        with pytest.raises(InvalidTensor, match="by its number"):
            c.lease("p", "latest", 30)  # type: ignore[arg-type]
        c.publish("p", {"x": torch.ones(2)})
        assert c.manifest("p").generation.number == 2  # and generation 1 went, as --keep-generations 1 says
    assert list(srv.server.generations._prefixes["p"].kept) == [2]


def test_a_grpc_lease_on_latest_is_refused(srv: tensorwire.ServerThread) -> None:
    with tensorwire.connect(srv.url) as c:
        c.publish("g", {"x": torch.zeros(2)})
    address = srv.addresses[1]

    async def lease() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(f"{address.host}:{address.port}") as channel:
            call = channel.unary_unary(f"/{SERVICE}/Lease", pb.LeaseRequest.SerializeToString,
                                       pb.LeaseReply.FromString)  # fmt: skip
            try:
                await call(pb.LeaseRequest(prefix="g", number=0, milliseconds=30_000), timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert "not 'latest'" in (exc.details() or "")
                return exc.code()
            raise AssertionError("a gRPC lease on 'latest' was granted")

    assert asyncio.run(lease()) != grpc.StatusCode.OK
    assert srv.server.generations.leases == 0


def test_leases_end_with_their_connection_and_only_it_releases_them(srv: tensorwire.ServerThread) -> None:
    with tensorwire.connect(srv.url) as holder:
        holder.publish("r", {"x": torch.zeros(2)})
        holder.lease("r", 1, 30)
        asyncio.run(_raw_lease(srv.url, "r", 1, 0))  # another connection's release of generation 1
        holder.publish("r", {"x": torch.ones(2)})
        assert _leased(srv, "r") == {1: 1}  # still held: a release speaks only for its own lease
    wait_for(
        lambda: 1 not in srv.server.generations._prefixes["r"].kept,
        10,
        "the lease to end with its connection",
    )


def test_one_client_host_holds_a_bounded_number_of_leases_over_all_its_connections(
    srv: tensorwire.ServerThread,
) -> None:
    connections = [tensorwire.connect(srv.url) for _ in range(3)]
    try:
        first = connections[0]
        for g in (1, 2):  # each leased as it comes: --keep-generations 1 retires the others
            first.publish("q", {"x": torch.full((2,), float(g))})
            first.lease("q", g, 30)
        first.publish("q", {"x": torch.full((2,), 3.0)})
        with pytest.raises(
            LimitExceeded, match=r"this connection holds 2 leases: at most 2 \(--leases-per-connection\)"
        ):
            first.lease("q", 3, 30)
        connections[1].lease("q", 3, 30)  # the host's third
        first.publish("q", {"x": torch.full((2,), 4.0)})
        with pytest.raises(LimitExceeded, match=r"holds 3 leases: at most 3 \(--leases-per-client\)"):
            connections[2].lease("q", 4, 30)
        connections[1].close()  # its lease ends with it: room for one more
        wait_for(lambda: srv.server.generations.leases == 2, 10, "the closed connection's lease to end")
        connections[2].lease("q", 4, 30)
    finally:
        for c in connections:
            c.close()
