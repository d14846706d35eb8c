"""Whatever speaks for a rank comes from that rank's own session. Before: a PS_INIT came from anyone
(it named a rank, but no session), so a client that had not joined could give a job its values
the moment a worker had joined it; and a job's worker dropped for missed heartbeats was made to
leave the gradient exchange under the same rank number, although that rank there was another
client's, so the exchange's rounds went on without that client."""

from __future__ import annotations

import secrets
import struct
import threading

import pytest
import torch
from psid_kit import call, config, flat_metas, init, join

from tensorwire.errors import ProtocolError, WaitTimeout, WorkerDropped
from tensorwire.ps import ParamServer
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread
from tensorwire.testing.process import wait_for
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

N = 16
KEY = f"w#0:{N}"


def test_an_init_from_outside_the_joined_session_changes_nothing() -> None:
    """Rank 0 joined (world 2) and has not initialised yet: a PS_INIT as rank 1, which nobody
    joined, or as rank 0 from another session, is refused; the job's values stay the worker's."""
    with ServerThread(extensions=[ParamServer(30)]) as server:
        session = secrets.randbits(63) or 1
        join(server.url, 0, 2, session)
        poison = {KEY: torch.full((N,), 1e9)}
        with pytest.raises(WorkerDropped, match="not part of job"):
            init(server.url, 1, 2, config(), poison, incarnation=session ^ 4)
        with pytest.raises(WorkerDropped, match="belongs to another session"):
            init(server.url, 0, 2, config(), poison, incarnation=session ^ 4)
        with pytest.raises(ProtocolError, match="carries no incarnation"):
            init(server.url, 0, 2, config(), poison, incarnation=0)
        (stats,) = server_stats([server.url])
        assert stats["shards"] == 0 and stats["mode"] is None
        init(server.url, 0, 2, config(), {KEY: torch.ones(N)}, incarnation=session)  # the worker's own
        assert server_stats([server.url])[0]["shards"] == 1


def allreduce(url: str, rank: int, step: int, session: int, wait_ms: int = 5000) -> int:
    """ALLREDUCE of one tensor as ``rank`` of a world of 2: how many workers its mean is over."""
    head = wps.PsHead(rank, 2, step, session, wait_ms).encode()
    body = head + wm.encode_records(flat_metas([("g", N)]))
    answer = call(url, Opcode.ALLREDUCE, body, [torch.ones(N)], answer_has_data=True)
    return int(struct.unpack("<I", answer[-4:])[0])


def test_a_job_worker_dropped_does_not_leave_anothers_exchange_rank() -> None:
    ps = ParamServer(30, heartbeat_timeout=0.3)
    sessions = [secrets.randbits(63) or 1 for _ in range(2)]
    with ServerThread(extensions=[ps]) as server:
        url = server.url
        step0 = threading.Thread(target=allreduce, args=(url, 0, 0, sessions[0]))
        step0.start()
        assert allreduce(url, 1, 0, sessions[1]) == 2  # the exchange's ranks 0 and 1, each a client's
        step0.join(10)
        # Rank 0 of a job (another client) joins, sends no heartbeat, and is dropped.
        join(url, 0, 1, secrets.randbits(63) or 1, job="other")
        stats = lambda: server_stats([url], job="other")[0]  # noqa: E731
        wait_for(lambda: stats()["workers_dropped"] == 1, 10, "the job's worker to be dropped")
        assert ps.exchange.held_by(0, ("seq", sessions[0])) and 0 not in ps.exchange.left
        with pytest.raises(WaitTimeout, match="worker"):  # step 1 still waits for the exchange's rank 0
            allreduce(url, 1, 1, sessions[1], wait_ms=300)
