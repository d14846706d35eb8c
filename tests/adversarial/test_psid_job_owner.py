"""Authorization across jobs: a job belongs to the holders of its job token (which its first worker
brought), and ending one also to the servers' operator. Before, any client the server admitted
(with --token-file: every worker of every job) could end another job with --force, join it under a
free rank and push into it, or (the job stepped aside) roll it back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from psid_kit import call

from tensorwire import cli
from tensorwire.errors import NotAuthorized
from tensorwire.ps import SGD, CheckpointPolicy, ParamServer, Worker
from tensorwire.ps.job import token_digest
from tensorwire.ps.worker.rpc import end_job, server_stats
from tensorwire.security import Security, write_token_file
from tensorwire.server import ServerThread
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

OWNERS = "the-alpha-job-token"
OPERATOR = "the-operator-token"


def linear() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(8, 3)


def worker(url: str, rank: int = 0, world: int = 2, token: str | None = OWNERS, job: str = "alpha") -> Worker:
    return Worker(linear(), url, "async", SGD(lr=0.1), rank=rank, world_size=world, heartbeat=0, job=job,
                  job_token=token)  # fmt: skip


def test_a_client_without_the_jobs_token_cannot_end_it() -> None:
    """`tensorwire ps end alpha --force` from a worker of another job (it has the servers' token,
    not alpha's) is refused, naming what was missing; alpha's workers carry on."""
    with ServerThread(extensions=[ParamServer(30)]) as server, worker(server.url) as owner:
        for offered in (b"", b"the-beta-job-token"):
            body = wps.PsHead(wps.OBSERVER, job="alpha").encode() + wps.encode_flag(True)
            with pytest.raises(NotAuthorized, match="job token") as refused:
                call(server.url, Opcode.PS_END, body + wps.encode_credential(offered))
            assert OWNERS not in str(refused.value)
        (stats,) = server_stats([server.url], job="alpha")
        assert list(stats["jobs"]) == ["alpha"] and stats["unauthorized_refused"] == 2
        assert stats["owner"] == "job token" and OWNERS not in json.dumps(stats)
        owner.step()  # the job is still there, still its workers'


def test_a_worker_without_the_jobs_token_cannot_join_it() -> None:
    """Rank 1 of alpha is free: a worker of the same model that lacks alpha's token (or has
    another) cannot take it and push into the job; nor can one with a token join an open job."""
    with ServerThread(extensions=[ParamServer(30)]) as server, worker(server.url):
        for token in (None, "the-beta-job-token"):
            with pytest.raises(NotAuthorized, match="job 'alpha'"):
                worker(server.url, rank=1, token=token).start()
        (stats,) = server_stats([server.url], job="alpha")
        assert stats["live"] == [0] and "1" not in stats["workers"]
        with (
            worker(server.url, rank=0, world=1, token=None, job="open"),
            pytest.raises(NotAuthorized, match="started without a job token"),
        ):
            worker(server.url, rank=0, world=1, token=OWNERS, job="open").start()
        with worker(server.url, rank=1):  # alpha's own token: it joins
            pass


def test_the_jobs_token_or_the_operators_ends_it(tmp_path: Path) -> None:
    ps = ParamServer(30, keep_jobs=True, operator_token=OPERATOR)
    with ServerThread(extensions=[ps]) as server:
        with worker(server.url, world=1):
            pass
        with worker(server.url, world=1, job="beta", token="the-beta-job-token"):
            pass
        end_job([server.url], "alpha", credential=OWNERS)
        with pytest.raises(NotAuthorized, match="operator token"):
            end_job([server.url], "beta", credential=OWNERS)  # alpha's token is not beta's
        operator = write_token_file(tmp_path / "operator.token", OPERATOR)
        ended = CliRunner().invoke(cli.main, ["ps", "end", "beta", server.url, "--operator-token-file",
                                              str(operator)])  # fmt: skip
        assert ended.exit_code == 0, ended.output
        (stats,) = server_stats([server.url])
        assert stats["jobs"] == {} and stats["operator"] is True
        assert [r["job"] for r in stats["ended"]] == ["alpha", "beta"]


def test_the_owner_survives_a_restart_from_checkpoints(tmp_path: Path) -> None:
    policy = CheckpointPolicy(tmp_path, every_steps=1)
    server = ServerThread(extensions=[ParamServer(30, checkpoints=policy, keep_jobs=True)])
    with server, worker(server.url, world=1) as w:
        w.step()
    restored = ParamServer(30, checkpoints=policy)
    assert restored.jobs.restore_all(tmp_path) == ["alpha"]
    with ServerThread(extensions=[restored]) as server:
        with pytest.raises(NotAuthorized, match="offers none"):
            worker(server.url, world=1, token=None).start()  # not the first to come back: refused
        with worker(server.url, world=1) as w:
            assert w.version == 1


def test_a_backup_knows_the_owner_and_refuses_after_a_failover() -> None:
    peer = Security(token="the-slot-peer-token")
    backup_ps = ParamServer(30, standby=True, failover_timeout=0.2, peer=peer)
    with (
        ServerThread(extensions=[backup_ps]) as backup,
        ServerThread(extensions=[ParamServer(30, backups=[backup.url], peer=peer)]) as primary,
    ):
        slot = f"{primary.url}|{backup.url}"
        with worker(slot, world=2) as w:
            run = backup_ps.job("alpha")
            assert run is not None and run.job.owner is not None and run.job.owner != b""
            primary.close()
            w.step()  # moves to the backup, which takes over
            assert backup_ps.role == "primary"
            with pytest.raises(NotAuthorized):
                worker(backup.url, rank=1, token="the-beta-job-token").start()


def test_a_state_transfer_carries_the_owner() -> None:
    with ServerThread(extensions=[primary := ParamServer(30)]) as server, worker(server.url, world=1):
        state, tensors = primary.jobs.take_all()
    backup = ParamServer(30)
    asyncio.run(backup.jobs.load_all(json.loads(json.dumps(state)), tensors))
    run = backup.job("alpha")
    assert run is not None and run.job.owner == token_digest(OWNERS.encode())


def test_serve_refuses_an_operator_token_that_is_the_clients(tmp_path: Path) -> None:
    token = write_token_file(tmp_path / "token", "the-same-secret")
    argv = ["ps", "serve", "--token-file", str(token), "--operator-token-file", str(token)]
    refused = CliRunner().invoke(cli.main, argv)
    assert refused.exit_code == 2 and "--operator-token-file must differ" in refused.output
