"""A leader key naming an address the slot was not given collects no peer credentials.

A backup whose primary went quiet probes the address in the slot's leader key (is that process
gone? then its lease is revoked at once), on a connection that offers the slot's peer token.
Anyone who may write the etcd prefix could name their own listener there and be sent the token.
Only the replicas a backup was given (``--backup``) are probed; any other leader waits out its
lease as a cut-off one does.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from tensorwire.coordinator import Leader, open_coordinator
from tensorwire.ps.server.leadership import Leadership
from tensorwire.security import Security
from tensorwire.testing.faults import silent_listener

pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")


class Backup:
    """A backup whose primary has been quiet since it started (``Led``, as leadership sees it)."""

    role = "backup"
    primary_seen = None
    peer = Security(token="the-slot-peer-token")

    def __init__(self, peers: list[str]) -> None:
        self.peers = peers

    def is_peer(self, address: str) -> bool:
        return address in self.peers


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Someone else's port: connections complete (the backlog), nothing answers."""
    with silent_listener() as sock:
        yield sock


def probed(listener: socket.socket, peers: list[str]) -> bool:
    """Whether a backup given ``peers`` connected to ``listener`` when the leader key named it."""
    url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    leader = Leader(url, url, epoch=9, lease=77, incarnation=5)

    async def look() -> bool:
        # Nothing contacts the coordinator unless the probe finds the process gone.
        leadership = Leadership(open_coordinator("etcd://127.0.0.1:9/tensorwire"), "s", "tcp://127.0.0.1:1")
        leadership.synced = True
        try:
            return await leadership._gone(leader, Backup(peers))
        finally:
            await leadership.coordinator.close()

    assert asyncio.run(look()) is False  # nothing answered: not known to be gone
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def test_a_leader_address_the_slot_was_not_given_is_not_probed(listener: socket.socket) -> None:
    assert not probed(listener, peers=["tcp://127.0.0.1:2"])


def test_a_replica_of_the_slot_is_probed(listener: socket.socket) -> None:
    """The control: the same look at a replica it was given does connect (the test can see it)."""
    url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    assert probed(listener, peers=[url])
