"""Who speaks for a relay reader: only the connection that registered it. A report over any other
connection (LEAVE, DONE, FAILED) is refused and changes nothing, no connection re-registers another's
address, a registration goes with its connection, one connection holds a bounded number of them, and
a hostile reader drops at most one upstream per generation (docs/protocol.md §15.3, §15.4)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest

import tensorwire
from tensorwire.broadcast.chains import Chains
from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.errors import InvalidName, LimitExceeded, ProtocolError
from tensorwire.server import metrics
from tensorwire.testing.process import wait_for
from tensorwire.testing.relay import PREFIX, RelayConn, model_tensors, origin, publish
from tensorwire.wire import relay as wr

ADDRESS = "tcp://127.0.0.1:{}"


def only_generation(coordinator: RelayCoordinator) -> dict[str, Any]:
    """The stats of the one generation of PREFIX the coordinator holds."""
    gens = coordinator.chains.stats(PREFIX)["generations"]
    assert isinstance(gens, list) and len(gens) == 1
    return dict(gens[0])


def test_a_report_over_another_connection_is_refused_and_changes_nothing() -> None:
    with origin() as (srv, coordinator), RelayConn(srv.url) as victim, RelayConn(srv.url) as hostile:
        generation = publish(srv.url, model_tensors(1))
        _, upstream = victim.join(ADDRESS.format(7000))
        _, placed = victim.join(ADDRESS.format(7001), prefix=PREFIX)  # replaces its first: one each
        assert coordinator.chains.readers() == 1 and upstream.reader != placed.reader
        for what in (wr.Report.LEAVE, wr.Report.DONE, wr.Report.FAILED):
            with pytest.raises(ProtocolError, match="another connection registered it"):
                hostile.report(generation, placed.reader, what)
        gen = only_generation(coordinator)
        assert gen["readers"] == 1 and gen["done"] == 0
        assert srv.server.status()["relay"]["identity_refused"] == 3
        scraped = metrics.parse(generate_latest(srv.server.registry).decode())
        assert ({"reason": "identity"}, 3.0) in scraped["tensorwire_relay_refused_total"]
        victim.report(generation, placed.reader, wr.Report.DONE)  # its own connection: applied
        gen = only_generation(coordinator)
        assert gen["done"] == 1


def test_no_connection_registers_an_address_another_holds() -> None:
    with origin() as (srv, coordinator), RelayConn(srv.url) as victim, RelayConn(srv.url) as hostile:
        publish(srv.url, model_tensors(1))
        victim.join(ADDRESS.format(7000))
        with pytest.raises(InvalidName, match="registered by another connection"):
            hostile.join(ADDRESS.format(7000))
        gen = only_generation(coordinator)
        assert gen["readers"] == 1
        assert coordinator.chains.readers_by_prefix() == {PREFIX: 1}
        _, again = victim.join(ADDRESS.format(7000))  # its owner may join again with it
        assert again.reader != 0


def test_a_registration_goes_with_its_connection() -> None:
    with origin() as (srv, coordinator):
        publish(srv.url, model_tensors(1))
        conn = RelayConn(srv.url)
        try:
            conn.join(ADDRESS.format(7000))
            assert coordinator.chains.readers() == 1
        finally:
            conn.close()
        wait_for(lambda: coordinator.chains.readers() == 0, 10, "the registration to go with its connection")
        assert coordinator.chains.addresses() == 0
        with RelayConn(srv.url) as other:  # the address is free again
            assert other.join(ADDRESS.format(7000))[1].reader != 0


def test_one_connection_holds_a_bounded_number_of_registrations() -> None:
    with origin(chains=Chains(max_per_owner=2)) as (srv, coordinator), RelayConn(srv.url) as conn:
        with tensorwire.connect(srv.url) as client:
            for i in range(3):
                client.put(f"p{i}/w", model_tensors(0)["fc2.weight"])
        conn.join(ADDRESS.format(7000), prefix="p0/")
        conn.join(ADDRESS.format(7001), prefix="p1/")
        with pytest.raises(LimitExceeded, match="max_per_owner"):
            conn.join(ADDRESS.format(7002), prefix="p2/")
        for _ in range(5):  # joining a prefix again replaces its registration there
            conn.join(ADDRESS.format(7003), prefix="p1/")
        assert coordinator.chains.readers() == 2 == coordinator.chains.addresses()


def test_a_hostile_reader_drops_at_most_one_upstream_per_generation() -> None:
    with origin() as (srv, coordinator):
        generation = publish(srv.url, model_tensors(1))
        conns = [RelayConn(srv.url) for _ in range(3)]
        try:
            honest = [conn.join(ADDRESS.format(7000 + i))[1] for i, conn in enumerate(conns[:2])]
            hostile = conns[2]
            for attempt in range(2):  # join behind the tail, report it failed, join again
                _, placed = hostile.join(ADDRESS.format(7010 + attempt))
                assert hostile.report(generation, placed.reader, wr.Report.FAILED, placed.upstream).reader
            gen = only_generation(coordinator)
            assert gen["dropped"] == 1 and gen["readers"] == 2  # the first honest reader stays
            gen_relay = coordinator.chains.find(PREFIX, generation)
            assert gen_relay is not None and honest[0].reader in gen_relay.readers
        finally:
            for conn in conns:
                conn.close()
