"""Who claims a job that has no owner yet (issue 32, reviews 1 #5 and 2 #5): a job restored from a
checkpoint written before job tokens (every upgraded deployment), or opened by a backup, is
unclaimed, and PS_STATS lists it so. Before, the first PS_JOIN or PS_INIT to name it claimed it,
before its own checks: a PS_JOIN that was then refused (another model, another world) claimed it
with the attacker's token, a non-member's PS_INIT with none made it open, and the job's own
workers were refused ever after. Now only an admitted PS_JOIN claims it (its rank and model
checked, under the step lock); a refused request, or any PS_INIT, claims nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from psid_kit import config, init

from tensorwire.errors import NotAuthorized, ProtocolError, TensorwireError
from tensorwire.ps import SGD, CheckpointPolicy, ParamServer, Worker
from tensorwire.ps.job import token_digest
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread

OWNERS = "the-alpha-job-token"
ATTACKER = "the-attackers-token"


def model(out: int = 3) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(8, out)


def worker(url: str, *, rank: int = 0, world: int = 1, token: str | None = OWNERS, out: int = 3) -> Worker:
    return Worker(model(out), url, "async", SGD(lr=0.1), rank=rank, world_size=world, heartbeat=0,
                  job="alpha", job_token=token)  # fmt: skip


def unclaimed_server(tmp_path: Path) -> ParamServer:
    """A parameter server holding job 'alpha' as a checkpoint written before job tokens left it:
    its state has no owner."""
    policy = CheckpointPolicy(tmp_path, every_steps=1)
    server = ServerThread(extensions=[ParamServer(30, checkpoints=policy, keep_jobs=True)])
    with server, worker(server.url) as w:
        w.step()
    for state in tmp_path.rglob("state.json"):
        body = json.loads(state.read_text())
        body.pop("owner", None)  # as an older release wrote it
        state.write_text(json.dumps(body))
    restored = ParamServer(30, checkpoints=policy)
    assert restored.jobs.restore_all(tmp_path) == ["alpha"]
    run = restored.job("alpha")
    assert run is not None and run.job.owner is None
    return restored


def owner(ps: ParamServer) -> bytes | None:
    run = ps.job("alpha")
    assert run is not None
    return run.job.owner


def test_a_refused_join_claims_nothing(tmp_path: Path) -> None:
    ps = unclaimed_server(tmp_path)
    with ServerThread(extensions=[ps]) as server:
        with pytest.raises(ProtocolError):  # another model under the job's id
            worker(server.url, token=ATTACKER, out=5).start()
        with pytest.raises(ProtocolError):  # a rank of another world
            worker(server.url, rank=1, world=2, token=ATTACKER).start()
        assert owner(ps) is None  # before: the attacker's token's
        (stats,) = server_stats([server.url], job="alpha")
        assert stats["owner"] == "unclaimed"
        with worker(server.url) as w:  # the job's own worker: before, NotAuthorized
            assert w.version == 1
            w.step()
            assert owner(ps) == token_digest(OWNERS.encode())
            with pytest.raises(NotAuthorized):  # claimed now: the attacker is refused
                worker(server.url, rank=0, token=ATTACKER).start()


def test_a_non_members_init_claims_nothing(tmp_path: Path) -> None:
    ps = unclaimed_server(tmp_path)
    with ServerThread(extensions=[ps]) as server:
        values = {key: torch.zeros(n) for key, n in (("weight", 24), ("bias", 3))}
        with pytest.raises(TensorwireError):  # no session of this incarnation joined the job
            init(server.url, 0, 1, config(lr=0.1), values, job="alpha", incarnation=0x5EED)
        assert owner(ps) is None  # before: b"" (open), and the owners' workers refused
        with worker(server.url) as w:  # before: NotAuthorized ("started without a job token")
            w.step()
            assert owner(ps) == token_digest(OWNERS.encode())
