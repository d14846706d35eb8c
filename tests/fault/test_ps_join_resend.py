"""A PS_JOIN resent after its answer was lost is the same join, not a rejoin.

``ServerSlot.call`` resends every request whose connection broke (ConnectionLost: "the request
may or may not have run"), PS_JOIN included; under load the connection breaks when the worker
drops it after two missed heartbeats (``ServerSlot._abandon``). If the server had admitted the
first PS_JOIN, the resend found the rank already in the job and admitted it again as a *rejoin*:
at step + 1 when other workers had pushed for the step already (``Members.joining_clock``), and
the step was then taken without it (``Lifecycle._join``: ``apply_ready_steps``). A rank joining
for the first time must start at step 0 however often its join is sent; otherwise the run is
shifted by a step and its bits differ from a fault-free run (tests/integration/test_ps_relay.py
once saw ``clock: 16`` after 15 steps for one rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tensorwire.errors import ConnectionLost
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.ps.worker.slot import ServerSlot
from tensorwire.server import ServerThread
from tensorwire.wire.frame import Opcode

W, B = 2, 8
DEADLINE = 60.0


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def backward(model: torch.nn.Module, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(B, 20, generator=gen), torch.randint(0, 5, (B,), generator=gen)
    F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]


def one_step_each(server: str) -> tuple[list[torch.nn.Module], int]:
    """Rank 0 joins and pushes for step 0 (recorded: the step waits for rank 1), then rank 1
    joins, and both take one step. The models, and rank 1's clock right after joining."""
    models = [small_model() for _ in range(W)]
    opts: dict[str, Any] = {"rank": 0, "world_size": W, "heartbeat": 0, "timeout": 20}
    with Worker(models[0], server, "sync", SGD(lr=0.1), **opts) as first:
        backward(models[0], 0)
        first.push().result(DEADLINE)
        with Worker(models[1], server, "sync", SGD(lr=0.1), **{**opts, "rank": 1}) as late:
            joined_at = late.clock
            assert joined_at == 0, "a rank joining for the first time starts at step 0"
            backward(models[1], 1)
            late.step()
        first.pull()
    return models, joined_at


@pytest.fixture
def lose_rank1_first_join_answer(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Rank 1's first PS_JOIN reaches the server and is answered, but the connection breaks
    before the worker reads the answer: ``ServerSlot.call`` resends it on a new connection.
    Yields the count of answers lost (checked: the fault fired)."""
    lost: list[int] = []
    real_connection = ServerSlot._connection

    class LosesJoinAnswer:
        def __init__(self, conn: Any) -> None:
            self.conn = conn

        async def call(
            self, opcode: int, meta: bytes, data: Sequence[memoryview] = (), sink: Any = None, **kw: Any
        ) -> Any:
            reader = await self.conn.call(opcode, meta, data, sink, **kw)
            if opcode == Opcode.PS_JOIN and not lost:
                lost.append(1)
                await self.conn.close()
                raise ConnectionLost("injected: the answer to PS_JOIN was lost with its connection")
            return reader

    async def connection(self: ServerSlot) -> Any:
        conn = await real_connection(self)
        return LosesJoinAnswer(conn) if self.rank == 1 else conn

    monkeypatch.setattr(ServerSlot, "_connection", connection)
    yield lost


def test_a_first_join_resent_after_its_answer_was_lost_still_joins_step_0(
    lose_rank1_first_join_answer: list[int],
) -> None:
    with ServerThread(extensions=[ParamServer(30.0, keep_jobs=True)]) as server:
        models, _ = one_step_each(server.url)
        (stats,) = server_stats([server.url])
    assert lose_rank1_first_join_answer == [1]  # the fault fired: PS_JOIN was sent twice
    assert stats["step"] == 1 and stats["pushes_applied"] == 2  # step 0 had both workers' pushes
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    with ServerThread(extensions=[ParamServer(30.0, keep_jobs=True)]) as server:
        clean, _ = one_step_each(server.url)  # the same run without the fault: the same bits
    for a, b in zip(models[0].parameters(), clean[0].parameters(), strict=True):
        assert torch.equal(a, b)
