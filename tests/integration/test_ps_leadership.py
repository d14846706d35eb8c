"""A replica slot whose primary a real etcd decides (``ParamServer(coordinator=...)``, ``ps serve
--coordinator``): the lease holder serves at etcd's epoch, a backup takes over when the term
ends, the in-sync set says who may, and a replica that is not up to date keeps the slot down
rather than lose acknowledged updates.

In-process servers on loopback (``ServerThread``) beside one ``LocalEtcd``; every wait polls a
condition under a deadline. tests/fault/test_ps_leadership_faults.py kills and stops processes.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import Iterator

import pytest
import torch

from tensorwire.coordinator import open_coordinator
from tensorwire.coordinator.local import LocalEtcd
from tensorwire.errors import NotPrimary
from tensorwire.ps import Coordination, ParamServer, Worker
from tensorwire.ps.launch import free_port
from tensorwire.security import Security
from tensorwire.server import ServerThread
from tensorwire.testing.process import param_server_of as ps_of
from tensorwire.testing.process import wait_for

pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")
pytestmark = [
    pytest.mark.slow,  # starts an etcd process
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd not on PATH (apt-get install etcd-server)"),
]

PEER = Security(token="the-peer-token-of-this-slot")
TTL = 1.0
WITHIN = 15.0  # a takeover: the ttl, a campaign, on a busy 2-core machine


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def leader_epoch(etcd: LocalEtcd, slot: str) -> int | None:
    async def read() -> int | None:
        coordinator = open_coordinator(etcd.url, timeout=2)
        try:
            leader = await coordinator.leader(slot)
            return leader.epoch if leader is not None else None
        finally:
            await coordinator.close()

    return asyncio.run(read())


def replica(etcd: LocalEtcd, slot: str, urls: list[str], index: int) -> ServerThread:
    """Replica ``index`` of a slot at ``urls``: each names the others as its backups; the first
    campaigns at once, the others (standbys) a ttl later."""
    ps = ParamServer(
        backups=[u for i, u in enumerate(urls) if i != index],
        peer=PEER,
        standby=index > 0,
        coordinator=Coordination(etcd.url, slot, urls[index], ttl=TTL, timeout=1.0),
    )
    return ServerThread([urls[index]], extensions=[ps])


def steps(worker: Worker, model: torch.nn.Module, first: int, count: int) -> None:
    for step in range(first, first + count):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        worker.step()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def reference(count: int) -> dict[str, torch.Tensor]:
    net = model()
    with ServerThread(extensions=[ParamServer()]) as plain, Worker(net, plain.url, "async", rank=0) as worker:
        steps(worker, net, 0, count)
    return net.state_dict()


def test_the_lease_holder_serves_at_etcds_epoch_and_a_backup_takes_over_when_it_resigns(
    etcd: LocalEtcd,
) -> None:
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    first, second = replica(etcd, "resign", urls, 0), replica(etcd, "resign", urls, 1)
    with second, first:
        wait_for(lambda: ps_of(first).role == "primary", WITHIN, "the first replica to win the lease")
        assert ps_of(second).role == "backup"
        epoch = ps_of(first).epoch
        assert epoch == leader_epoch(etcd, "resign")  # the fencing token is etcd's
        net = model()
        with Worker(net, "|".join(urls), "async", rank=0, timeout=60) as worker:
            steps(worker, net, 0, 3)
            wait_for(lambda: urls[1] in ps_of(first)._replica.in_sync(), WITHIN, "the backup in sync")
            first.close()  # it resigns: the backup need not wait out the lease
            wait_for(lambda: ps_of(second).role == "primary", WITHIN, "the backup to take over")
            assert ps_of(second).epoch > epoch
            steps(worker, net, 3, 3)
    expected = reference(6)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in expected.items())


def test_a_replica_that_restarted_empty_does_not_take_over_and_says_why(etcd: LocalEtcd) -> None:
    """The primary writes the in-sync set; a replica started afresh on a listed address has not
    received the state in this life, so when the primary is gone the slot stays down (said in
    its stats) instead of serving an empty job."""
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    first = replica(etcd, "down", urls, 0)
    with first:
        wait_for(lambda: ps_of(first).role == "primary", WITHIN, "the first replica to win the lease")
        with replica(etcd, "down", urls, 1):
            net = model()
            with Worker(net, "|".join(urls), "async", rank=0, timeout=60) as worker:
                steps(worker, net, 0, 2)
                wait_for(lambda: urls[1] in ps_of(first)._replica.in_sync(), WITHIN, "the backup in sync")
        # The backup is gone (stopped): the primary drops it from the in-sync set at its next ping.
        wait_for(lambda: urls[1] not in ps_of(first)._replica.in_sync(), WITHIN, "the backup out of sync")
        wait_for(lambda: ps_of(first).leadership_status()["in_sync"] == [urls[0]], WITHIN, "the set written")
    # Now the primary is gone too, and the backup comes back empty on its address.
    with replica(etcd, "down", urls, 1) as revived:
        wait_for(lambda: ps_of(revived).leadership_status()["down"], WITHIN, "the slot to be said down")
        assert ps_of(revived).role == "backup"
        assert "not in it" in ps_of(revived).leadership_status()["down"]
        with pytest.raises(NotPrimary, match="no primary is known"):
            ps_of(revived)._replica.serving()


def test_a_backup_tells_a_restarted_primary_from_the_one_holding_the_lease() -> None:
    """A primary's port served by another process (killed and started again at once, as a
    supervisor does) says another store id in its HELLO than the lease's incarnation, and a port
    nothing listens on refuses: either way the process holding the lease is gone, and its lease
    may be revoked without waiting it out. The same process, or one that does not answer, is not
    gone."""
    from tensorwire.coordinator import Leader
    from tensorwire.ps.server.leadership import GONE, look_at

    with ServerThread(extensions=[ParamServer(peer=PEER)]) as other, socket.socket() as silent:
        store_id = other.server.store_id
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts (the kernel does), never answers a HELLO

        def gone(incarnation: int, address: str = other.url) -> bool:
            return asyncio.run(look_at(Leader("m", address, 5, 9, incarnation), PEER)) in GONE

        assert gone(store_id ^ 1) is True  # another process answers there
        assert gone(store_id) is False  # the leader itself
        assert gone(0) is False  # a leader that did not say which process it is
        assert (
            gone(store_id ^ 1, f"tcp://127.0.0.1:{silent.getsockname()[1]}") is False
        )  # no answer: not known
        assert gone(store_id, f"tcp://127.0.0.1:{free_port()}") is True  # nothing listens there
