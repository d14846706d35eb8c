"""Issue 13, item 3: only the replicas of a slot may replicate. A PS_REPLICATE frame from an
ordinary client (with or without the client token) must neither demote nor fence a primary, nor
keep a backup from taking over; epochs out of range are refused even from a peer, so a promotion
never overflows; a replica without a peer token does not start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tensorwire import transport as transports
from tensorwire._aio import run
from tensorwire.errors import AuthenticationError, NotPrimary, ProtocolError
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.server import replication as rp
from tensorwire.security import Security, write_token_file
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

CLIENT = "the-clients-token"
PEER = Security(token="the-slot-peer-token")
TOP = (1 << 64) - 1  # the largest u64: what the attacker sent


def replicate(url: str, epoch: int, token: str | None) -> None:
    """One hand-made PS_REPLICATE (a PING at ``epoch``) on a connection that offered ``token``."""

    async def call() -> None:
        options = transports.TransportOptions(5.0, 10.0, security=Security(token=token))
        conn = await transports.open_transport(Address.parse(url), options)
        try:
            assert isinstance(conn, FramedTransport)
            meta = rp.encode(rp.Change.PING, epoch, wps.PsHead(wps.OBSERVER))
            (await conn.call(Opcode.PS_REPLICATE, meta, [], what="a hand-made PS_REPLICATE")).done()
        finally:
            await conn.close()

    run(call())


def train(url: str, count: int, token: str | None = None) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    with Worker(net, url, "async", SGD(lr=0.1), rank=0, token=token, heartbeat=0, timeout=20) as worker:
        for _ in range(count):
            F.mse_loss(net(torch.ones(3, 4)), torch.zeros(3, 2)).backward()  # type: ignore[no-untyped-call]
            worker.step()


@pytest.mark.parametrize("client_token", [None, CLIENT], ids=["no-token", "client-token"])
def test_an_ordinary_client_can_neither_demote_nor_fence_a_primary(client_token: str | None) -> None:
    # The job is kept when its worker leaves: the second run of it goes on from the first.
    backup_ps = ParamServer(standby=True, failover_timeout=30, peer=PEER, keep_jobs=True)
    with ServerThread(options=ServerOptions(token=client_token), extensions=[backup_ps]) as backup:
        primary_ps = ParamServer(backups=[backup.url], peer=PEER, keep_jobs=True)
        with ServerThread(options=ServerOptions(token=client_token), extensions=[primary_ps]) as primary:
            train(primary.url, 1, client_token)
            for epoch in (1, 2, TOP):  # its own epoch (a demotion), a newer one, the top (fencing)
                with pytest.raises(AuthenticationError, match="PS_REPLICATE is served only to the replicas"):
                    replicate(primary.url, epoch, client_token)
            assert (primary_ps.role, primary_ps.epoch) == ("primary", 1)
            assert primary_ps.replicate_refused["not_peer"] == 3
            reading = primary.server.registry.get_sample_value
            assert reading("tensorwire_ps_replicate_refused_total", {"reason": "not_peer"}) == 3
            train(primary.url, 1, client_token)  # it still serves, and still replicates
            assert primary_ps.version == backup_ps.version == 2
            with pytest.raises(AuthenticationError):  # nor can one hold a backup's primary "alive"
                replicate(backup.url, 1, client_token)
            assert (backup_ps.role, backup_ps.epoch) == ("backup", 1)


@pytest.mark.parametrize("epoch", [0, rp.MAX_EPOCH, TOP])
def test_an_epoch_out_of_range_is_refused_even_from_a_peer(epoch: int) -> None:
    primary_ps = ParamServer(backups=["tcp://127.0.0.1:1"], peer=PEER)  # (a backup that is down)
    with ServerThread(extensions=[primary_ps]) as primary:
        with pytest.raises(ProtocolError, match="out of range"):
            replicate(primary.url, epoch, PEER.token)
        assert (primary_ps.role, primary_ps.epoch) == ("primary", 1)  # not fenced, not demoted
        assert primary_ps.replicate_refused["malformed"] == 1


def test_a_backup_at_the_highest_epoch_a_peer_may_send_takes_over_without_overflow() -> None:
    backup_ps = ParamServer(standby=True, failover_timeout=0.2, peer=PEER)
    with ServerThread(extensions=[backup_ps]) as backup:
        replicate(backup.url, rp.MAX_EPOCH - 2, PEER.token)  # a (legitimate) primary at that epoch
        assert backup_ps.epoch == rp.MAX_EPOCH - 2
        wait_for(lambda: backup_ps.primary_seen is not None, 5, "the ping to be noted")
        train(backup.url, 2)  # its primary falls silent: the next worker request promotes it
        assert (backup_ps.role, backup_ps.epoch, backup_ps.version) == ("primary", rp.MAX_EPOCH - 1, 2)


def test_an_ordinary_client_cannot_make_a_backup_take_over_early() -> None:
    """Only a primary silent for the failover timeout lets a backup take over: a worker's request
    to a backup whose primary pings is answered NOT_PRIMARY and changes nothing."""
    backup_ps = ParamServer(standby=True, failover_timeout=1.0, peer=PEER)
    with ServerThread(extensions=[backup_ps]) as backup:
        primary_ps = ParamServer(backups=[backup.url], peer=PEER)
        with ServerThread(extensions=[primary_ps]) as primary:
            train(primary.url, 1)
            with pytest.raises(NotPrimary):
                Worker(torch.nn.Linear(4, 2), backup.url, "async", rank=0, heartbeat=0, timeout=5).start()
            assert (backup_ps.role, backup_ps.epoch) == ("backup", 1)


def test_a_replica_without_a_peer_token_does_not_start(tmp_path: Path) -> None:
    for flags in (["--standby"], ["--backup", "tcp://127.0.0.1:1"]):
        with pytest.raises(RuntimeError, match="--peer-token-file"):
            ServerProcess(extra=flags, start_timeout=60)
    token = str(write_token_file(tmp_path / "same.token"))
    with pytest.raises(RuntimeError, match="another secret"):
        ServerProcess(
            extra=["--standby", "--peer-token-file", token, "--token-file", token], start_timeout=60
        )
    with pytest.raises(ValueError, match="peer token"):
        ParamServer(standby=True)
    with pytest.raises(ValueError, match="peer token"):
        ParamServer(backups=["tcp://127.0.0.1:1"], peer=Security())
    with pytest.raises(ValueError, match="differ from the clients' token"):
        ServerThread(
            options=ServerOptions(token="same"),
            extensions=[ParamServer(standby=True, peer=Security(token="same"))],
        )
