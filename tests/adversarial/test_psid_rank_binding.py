"""A rank belongs to the session (worker process) that joined with it: a request under that rank
from anyone else is refused before it changes anything, and the real worker carries on, after a
reconnect and after a failover too."""

from __future__ import annotations

import pytest
import torch
from psid_kit import call, pull, push

from tensorwire.errors import ProtocolError, WorkerDropped
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.security import Security
from tensorwire.server import ServerThread
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def train_step(net: torch.nn.Module, worker: Worker) -> int:
    """One step of the real worker; the version the servers answered."""
    net(torch.ones(2, 8)).pow(2).mean().backward()  # type: ignore[no-untyped-call]
    result = worker.step()
    assert not result.rejoined
    return result.version


def forged_grads(worker: Worker) -> dict[str, torch.Tensor]:
    """Huge gradients for every shard the worker holds on server 0."""
    return {s.key: torch.full((s.numel,), 1e6) for s in worker.placement.on_server(0)}


def test_a_forged_push_under_a_live_rank_is_refused_and_the_real_push_is_applied() -> None:
    net = model()
    ps = ParamServer()
    with (
        ServerThread(extensions=[ps]) as server,
        Worker(net, [server.url], "async", SGD(lr=0.1), rank=0, world_size=1, heartbeat=0) as worker,
    ):
        grads = forged_grads(worker)
        # Push 1 of worker 0, from another connection: as an older peer's frame (no incarnation)...
        with pytest.raises(ProtocolError, match="carries no incarnation"):
            push(server.url, grads, incarnation=0, job=worker.job)
        # ... and claiming a session, which is not the one that joined.
        with pytest.raises(WorkerDropped, match="belongs to another session"):
            push(server.url, grads, incarnation=worker.incarnation ^ 1, job=worker.job)
        # Nor can anyone else make it leave.
        leave = wps.PsHead(0, 1, 0, worker.incarnation ^ 1, job=worker.job).encode()
        with pytest.raises(WorkerDropped, match="belongs to another session"):
            call(server.url, Opcode.PS_LEAVE, leave)
        (stats,) = server_stats([server.url])
        assert stats["pushes_applied"] == 0 and stats["workers"]["0"] == {"clock": 0, "live": True, "seq": 0}
        assert stats["identity_refused"] == 3
        assert str(worker.incarnation) not in str(stats)  # the session is never shown

        assert train_step(net, worker) == 1  # push 1 of the real worker: applied, not a "duplicate"
        (stats,) = server_stats([server.url])
        assert stats["pushes_applied"] == 1 and stats["duplicates_ignored"] == 0
        assert all(bool(p.abs().max() < 1e3) for p in net.parameters())  # no forged 1e6 in them

        # After a reconnect the same session goes on (the incarnation travels with every request).
        conn = worker._slots[0].conn
        assert conn is not None
        worker._loop().call(conn.close(), 10, "dropping the worker's connection")
        assert train_step(net, worker) == 2


def test_a_forged_pull_does_not_keep_a_rank_alive_or_move_its_read_clock() -> None:
    net = model()
    ps = ParamServer(heartbeat_timeout=60)
    with (
        ServerThread(extensions=[ps]) as server,
        Worker(net, [server.url], "ssp:2", SGD(lr=0.1), rank=0, world_size=1, heartbeat=0) as worker,
    ):
        keys = [s.key for s in worker.placement.on_server(0)]
        heard, read = ps.workers[0].heard, ps.workers[0].read_clock
        for incarnation in (0, worker.incarnation + 1):
            with pytest.raises((ProtocolError, WorkerDropped)):
                pull(server.url, 0, keys, incarnation, job=worker.job)
        assert (ps.workers[0].heard, ps.workers[0].read_clock) == (heard, read)
        assert ps.identity_refused == 2
        pull(server.url, 0, keys, worker.incarnation, job=worker.job)  # the session itself, on any connection
        assert train_step(net, worker) == 1


def test_after_a_failover_the_session_still_pushes_and_a_forger_still_cannot() -> None:
    net = model()
    peer = Security(token="the-slot-peer-token")  # replicas of a slot share one (issue 13, item 3)
    backup_ps = ParamServer(standby=True, failover_timeout=0.2, peer=peer)
    with (
        ServerThread(extensions=[backup_ps]) as backup,
        ServerThread(extensions=[ParamServer(backups=[backup.url], peer=peer)]) as primary,
        Worker(net, f"{primary.url}|{backup.url}", "async", SGD(lr=0.1), rank=0, world_size=1,
               heartbeat=0) as worker,
    ):  # fmt: skip
        assert train_step(net, worker) == 1
        primary.close()  # the next step moves to the backup, which takes over
        assert train_step(net, worker) == 2
        assert backup_ps.role == "primary"
        with pytest.raises(WorkerDropped, match="belongs to another session"):
            push(
                backup.url,
                forged_grads(worker),
                seq=3,
                incarnation=worker.incarnation ^ 2,
                clock=2,
                job=worker.job,
            )
        assert train_step(net, worker) == 3
        assert backup_ps.pushes == 3 and backup_ps.duplicates == 0
