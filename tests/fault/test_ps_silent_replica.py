"""A replica that accepts connections and never answers holds up neither a worker's move nor a
new primary's changes.

A stopped (SIGSTOP) or wedged primary still completes TCP handshakes (the kernel does, from the
listen backlog), so a connection to it opens and then waits for a HELLO that never comes, until
its connect timeout. In the etcd chaos run that wait held the slot twice after the lease had
passed to the backup:

* ``ServerSlot.follow`` (the coordinator names another primary) took the lock under which the
  worker's request was opening its connection to the stopped one: the move, and the request,
  waited out the open; the workers followed only when the stopped primary was continued.
* The new primary's first change went to its peers, the stopped old primary among them, and
  waited for that connection (5 s) before it could be acknowledged. With a coordinator it takes
  the old primary back in the background, as a lost backup (``Backups.reset(previous)``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tensorwire.ps import ParamServer
from tensorwire.ps.server import replication
from tensorwire.ps.worker.rpc import Sender
from tensorwire.ps.worker.slot import ServerSlot
from tensorwire.security import Security
from tensorwire.server import ServerThread
from tensorwire.testing.faults import silent_listener
from tensorwire.transport import TransportOptions
from tensorwire.wire import ps as wps

CONNECT_TIMEOUT = 30.0  # what the open to the silent replica would wait without the move


@pytest.fixture
def silent() -> Iterator[str]:
    """A listening socket nobody accepts from: connections open, nothing ever answers."""
    with silent_listener() as sock:
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_follow_ends_an_open_waiting_on_a_silent_replica(silent: str) -> None:
    with ServerThread(extensions=[ParamServer()]) as server:

        async def scenario() -> dict[str, object]:
            options = TransportOptions(CONNECT_TIMEOUT, CONNECT_TIMEOUT)
            slot = ServerSlot(f"{silent}|{server.url}", [], rank=0, sender=Sender(), options=options,
                              timeout=2 * CONNECT_TIMEOUT)  # fmt: skip
            try:
                asked = asyncio.ensure_future(slot.rpc.stats(0))
                deadline = time.monotonic() + 10
                while slot._opening is None:  # the request is opening its connection to the silent one
                    assert time.monotonic() < deadline, "the request never began to connect"
                    assert not asked.done(), asked
                    await asyncio.sleep(0.01)
                # Both now, not after the open's timeout.
                assert await asyncio.wait_for(slot.follow(server.url), 5)
                return await asyncio.wait_for(asked, 5)
            finally:
                await slot.close()

        doc = asyncio.run(scenario())
    assert doc["role"] == "primary"  # the real server's answer


def test_a_new_primary_with_a_coordinator_does_not_wait_for_a_silent_old_one(silent: str) -> None:
    other = "tcp://127.0.0.1:1"  # another replica of the slot, not the old primary

    async def scenario() -> replication.Backup:
        peers = [silent, other]
        backups = replication.Backups(peers, Security(token="peer"), connect_timeout=CONNECT_TIMEOUT)
        try:
            backups.reset(previous=silent)  # a takeover of its lease from the silent one
            assert not backups.backups[other].lost  # the others are waited for, as at a first election
            meta = replication.encode(replication.Change.PING, 7, wps.PsHead(wps.OBSERVER))
            # A change, then a ping: neither waits for the silent one (it is reconnected apart).
            await asyncio.wait_for(backups.send(meta), 5)
            await asyncio.wait_for(backups.send(meta, ping=True), 5)
            backup = backups.backups[silent]
            assert backup.reconnecting is not None and not backup.reconnecting.done()
            return backup
        finally:
            await backups.close()

    backup = asyncio.run(scenario())
    assert backup.lost and not backup.synced and backup.behind == 1  # visibly without that copy
