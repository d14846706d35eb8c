"""What an authenticated but hostile reader can make the relay's coordinator and peers hold or do:
advertised addresses are checked, every table is bounded, a report drops only the reporter's own
upstream, one RELAY_GET answer and one parked wait are capped (docs/protocol.md §15.4)."""

from __future__ import annotations

import time

import pytest
import torch

import tensorwire
from tensorwire import transport
from tensorwire._aio import run
from tensorwire.broadcast.chains import Chains
from tensorwire.broadcast.coordinator import MAX_GET_CHUNKS
from tensorwire.broadcast.peer import RelayPeer
from tensorwire.errors import LimitExceeded, ProtocolError, VersionChanged, WaitTimeout
from tensorwire.server import ServerThread
from tensorwire.testing.process import wait_for
from tensorwire.testing.relay import CHUNK, PREFIX, RelayConn, model_tensors, origin, publish
from tensorwire.transport import TransportOptions
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode


async def _call(
    url: str, opcode: int, body: bytes, sink: bool = False
) -> tuple[wm.MetaReader, list[TensorMeta]]:
    channel = await transport.open_channel(url, TransportOptions(5.0, 10.0), what="a hostile reader")
    landed: list[TensorMeta] = []

    def land(metas: list[TensorMeta]) -> list[memoryview]:
        landed.extend(metas)
        return [memoryview(bytearray(m.nbytes)) for m in metas]

    try:
        reader = await channel.call(opcode, body, sink=land if sink else None, what=Opcode(opcode).name)
        return reader, landed
    finally:
        await channel.close()


def call(url: str, opcode: int, body: bytes, sink: bool = False) -> tuple[wm.MetaReader, list[TensorMeta]]:
    return run(_call(url, opcode, body, sink))


def join(url: str, relay: str, prefix: str = PREFIX) -> wr.Placement:
    """A join over a connection that closes at once: what it registered goes with it."""
    reader, _ = call(url, Opcode.RELAY_JOIN, wr.encode_join(prefix, 0, relay))
    return wr.decode_join_reply(reader, 1 << 20)[1]


@pytest.mark.parametrize(
    "relay",
    [
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:70000",
        "grpc://127.0.0.1:7070",
        "memory://somewhere",
        "tcp://bad_host!:7070",
        "tcp://" + "a" * 300 + ":7070",
        "tcp://-leading.example:7070",
        "127.0.0.1:7070",
    ],
)
def test_a_join_advertising_a_bad_address_is_refused_and_registers_nothing(relay: str) -> None:
    with origin() as (srv, coordinator):
        publish(srv.url, model_tensors(1))
        try:
            placement = join(srv.url, relay)
        except (LimitExceeded, ProtocolError):
            placement = None  # too long to decode: the frame is refused
        assert placement in (None, wr.Placement(0, 0, ""))  # else: read from the origin, unregistered
        assert coordinator.chains.readers() == 0 and coordinator.chains.stats(PREFIX)["generations"] == []


def test_readers_per_generation_are_bounded_and_the_rest_read_from_the_origin() -> None:
    with origin(chains=Chains(max_readers=3, max_chain=2)) as (srv, coordinator):
        publish(srv.url, model_tensors(1))
        conns = [RelayConn(srv.url) for _ in range(10)]
        try:
            placements = [c.join(f"tcp://127.0.0.1:{7000 + i}")[1] for i, c in enumerate(conns)]
            assert coordinator.chains.readers() == 3
        finally:
            for conn in conns:
                conn.close()
        assert [p.reader != 0 for p in placements] == [True] * 3 + [False] * 7
        assert all(p.upstream == 0 and p.address == "" for p in placements[3:])
        # max_chain=2: the third reader starts a new chain at the origin.
        assert placements[1].upstream == placements[0].reader and placements[2].upstream == 0
        wait_for(lambda: coordinator.chains.readers() == 0, 10, "the readers to go with their connections")


def test_generations_and_prefixes_kept_are_bounded() -> None:
    chains = Chains(keep=2, max_prefixes=3, max_per_owner=64)
    with origin(chains=chains) as (srv, coordinator), RelayConn(srv.url) as conn:
        for seed in range(5):
            publish(srv.url, model_tensors(seed))
            conn.join("tcp://127.0.0.1:7000")
        stats = coordinator.chains.stats(PREFIX)
        assert len(stats["generations"]) == 2  # type: ignore[arg-type]
        assert coordinator.chains.readers() == 1  # each join replaced the connection's last one
        with tensorwire.connect(srv.url) as client:
            for i in range(6):
                client.put(f"p{i}/w", model_tensors(0)["fc2.weight"])
                conn.join(f"tcp://127.0.0.1:{7001 + i}", prefix=f"p{i}/")
        assert len(coordinator.chains.served_total) <= 3 and coordinator.chains.readers() <= 3
        # Retired generations and dropped prefixes take their readers' addresses with them.
        assert coordinator.chains.addresses() == coordinator.chains.readers()


def test_a_report_drops_only_the_reporters_own_upstream() -> None:
    with origin() as (srv, coordinator):
        generation = publish(srv.url, model_tensors(1))
        conns = [RelayConn(srv.url) for _ in range(3)]
        try:
            first, second, third = (c.join(f"tcp://127.0.0.1:{7000 + i}")[1] for i, c in enumerate(conns))
            reporter = conns[2]
            # The first one is not the third one's upstream; 12345 is no reader at all.
            for victim in (first.reader, 12345):
                assert reporter.report(generation, third.reader, wr.Report.FAILED, victim).upstream == 0
            assert coordinator.chains.readers() == 3
            # The third reads from the origin now: a report about the second one drops nobody.
            reporter.report(generation, third.reader, wr.Report.FAILED, second.reader)
            assert coordinator.chains.readers() == 3
        finally:
            for conn in conns:
                conn.close()


def test_one_relay_get_answer_is_capped_and_a_chunk_outside_the_generation_refused() -> None:
    with origin() as (srv, _):
        generation = publish(srv.url, {"big": model_tensors(1)["fc1.weight"].repeat(8, 1)})  # 2.4 MiB
        body = wr.encode_get(PREFIX, generation, 0, 0xFFFFFFFF, 0xFFFFFFFF)
        _, landed = call(srv.url, Opcode.RELAY_GET, body, sink=True)
        assert landed[0].nbytes <= MAX_GET_CHUNKS * CHUNK
        with pytest.raises(ProtocolError):
            call(srv.url, Opcode.RELAY_GET, wr.encode_get(PREFIX, generation, 1 << 40, 1, 0))


def test_a_peer_parks_a_relay_get_no_longer_than_its_cap() -> None:
    peer = RelayPeer(max_wait=0.3)
    manifest = wr.Manifest(7, 16, (TensorMeta("p/x", torch.uint8, (32,), 32, 7),), (0, 0))
    peer.hold("p/", manifest, [memoryview(bytearray(32))])  # nothing verified yet
    with ServerThread(extensions=[peer]) as srv:
        started = time.monotonic()
        with pytest.raises(WaitTimeout):
            call(srv.url, Opcode.RELAY_GET, wr.encode_get("p/", 7, 0, 1, 0xFFFFFFFF))
        assert time.monotonic() - started < 5.0
        with pytest.raises(VersionChanged):  # a generation it does not hold
            call(srv.url, Opcode.RELAY_GET, wr.encode_get("p/", 6, 0, 1, 0))


def test_joining_many_prefixes_evicts_no_relay_with_readers() -> None:
    """One client publishes many prefixes and joins every one, without an address and then with
    addresses over several connections: a join that registers nothing makes no table, and a new
    table takes only the place of one without readers, so the honest relay keeps its readers (and
    its tables' served bytes); the hostile joins read from the origin, counted."""
    chains = Chains(max_prefixes=4, max_per_owner=4)
    with origin(chains=chains) as (srv, coordinator), RelayConn(srv.url) as honest:
        publish(srv.url, model_tensors(1))
        assert honest.join("tcp://127.0.0.1:7000")[1].reader != 0  # the relay of PREFIX, one reader
        with tensorwire.connect(srv.url) as client:
            for i in range(8):
                client.put(f"p{i}/w", torch.ones(4))
        with RelayConn(srv.url) as hostile:
            for i in range(8):  # no address: it reads from the origin and leaves no table
                assert hostile.join("", prefix=f"p{i}/")[1].reader == 0
            assert list(chains.readers_by_prefix()) == [PREFIX]
        conns = [RelayConn(srv.url) for _ in range(2)]
        try:
            placed = [c.join(f"tcp://127.0.0.1:{7100 + 4 * n + i}", prefix=f"p{4 * n + i}/")[1]
                      for n, c in enumerate(conns) for i in range(4)]  # fmt: skip
            assert sum(p.reader != 0 for p in placed) == 3  # the free tables; the rest from the origin
            assert chains.readers_by_prefix()[PREFIX] == 1 and coordinator.unadmitted_by["tables"] == 5
        finally:
            for conn in conns:
                conn.close()
        # Their readers gone, their tables are the first to go for a new prefix's relay.
        wait_for(lambda: chains.readers() == 1, 10, "the hostile registrations to go with their connections")
        with RelayConn(srv.url) as late:
            assert late.join("tcp://127.0.0.1:7200", prefix="p7/")[1].reader != 0
        assert chains.readers_by_prefix()[PREFIX] == 1
