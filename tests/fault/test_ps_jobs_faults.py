"""Two jobs on the same parameter servers through faults: a replica pair whose primary is killed
(-9) goes on with both jobs bit-identically, and a server started again resumes each job from
its own checkpoint directory. Real server processes; workers in threads."""

from __future__ import annotations

from pathlib import Path

import ps_job
import torch
import torch.nn.functional as F

from tensorwire.ps import SGD, ParamServer, Worker, pull_parameters
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.security import write_token_file
from tensorwire.server import ServerThread
from tensorwire.testing.faults import Fault, FaultSchedule, kill9
from tensorwire.testing.process import ServerProcess, run_threads, wait_for

DEADLINE = 120.0
STEPS = 40


def linear() -> torch.nn.Module:
    with ps_job._SEEDING:  # the one lock of torch's global generator: workers in threads take turns
        torch.manual_seed(3)
        return torch.nn.Linear(16, 4)


# job "a": sync, two workers, ps_job's MLP; job "b": async, one worker, a linear model
JOBS = {"a": ("sync", 2, ps_job.model), "b": ("async", 1, linear)}


def train(servers: str, job: str, rank: int, progress: dict[str, int]) -> dict[str, torch.Tensor]:
    mode, world, make = JOBS[job]
    net = make()
    with Worker(net, servers, mode, SGD(lr=0.05, momentum=0.9), rank=rank, world_size=world, job=job,
                timeout=60, heartbeat=0.2) as worker:  # fmt: skip
        for step in range(STEPS):
            x, y = ps_job.batch(rank + 10 * (job == "b"), step)
            F.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
            worker.step()
            progress[f"{job}{rank}"] = step + 1
    return {k: v.clone() for k, v in net.state_dict().items()}


def both_jobs(servers: str, progress: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
    """Job a's two workers and job b's one, at once; each worker's final parameters."""
    who = [("a", 0), ("a", 1), ("b", 0)]
    out: dict[str, dict[str, torch.Tensor]] = {}

    def work(i: int) -> None:
        job, rank = who[i]
        out[f"{job}{rank}"] = train(servers, job, rank, progress)

    run_threads(work, len(who), DEADLINE)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_killing_the_primary_of_two_jobs_fails_both_over_bit_identically(tmp_path: Path) -> None:
    with ServerThread(extensions=[ParamServer(60)]) as plain:
        expected = both_jobs(plain.url, {})
    peer = ["--peer-token-file", str(write_token_file(tmp_path / "peer.token"))]
    progress: dict[str, int] = {}
    with ServerProcess(extra=["--standby", "--failover-timeout", "1", *peer]) as backup:
        primary = ServerProcess(extra=["--backup", backup.url, *peer])
        try:
            # Both jobs are under way on the primary when it is killed.
            kill = FaultSchedule(
                [Fault("kill -9 the primary", kill9(primary.proc),
                       when=lambda: min(progress.get("a0", 0), progress.get("b0", 0)) >= 10)]
            )  # fmt: skip
            with kill.running():
                got = both_jobs(f"{primary.url}|{backup.url}", progress)
            kill.assert_fired()
        finally:
            primary.stop()
        (stats,) = server_stats([backup.url])
    assert stats["role"] == "primary" and stats["failovers"] == 1
    ended = {e["job"]: e for e in stats["ended"]}  # each ended on the backup with its last worker
    assert ended["a"]["step"] == STEPS and ended["b"]["version"] == STEPS  # none lost, none twice
    for name, state in got.items():
        assert same(state, expected[name]), name


def test_each_job_resumes_from_its_own_checkpoints_after_a_restart(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(directory), "--checkpoint-every", "5", "--keep-jobs"]
    server = ServerProcess(extra=flags)
    try:
        nets = {job: make() for job, (_, _, make) in JOBS.items()}
        for job, (mode, _, _) in JOBS.items():
            with Worker(nets[job], server.url, mode, SGD(lr=0.05), rank=0, world_size=1, job=job,
                        heartbeat=0) as worker:  # fmt: skip
                for step in range(3 + 4 * (job == "b")):
                    x, y = ps_job.batch(0, step)
                    F.cross_entropy(nets[job](x), y).backward()  # type: ignore[no-untyped-call]
                    worker.step()
        url = server.url
    finally:
        server.stop()  # SIGTERM: each job's last checkpoint, in its own directory
    assert sorted(p.name for p in directory.iterdir()) == ["a", "b"]
    with ServerProcess(listen=url, extra=flags) as again:
        jobs = server_stats([again.url])[0]["jobs"]
        assert {job: (s["version"], s["live"]) for job, s in jobs.items()} == {"a": (3, 0), "b": (7, 0)}
        assert "resumed job a" in again.output() and "resumed job b" in again.output()
        for job in JOBS:
            fresh = JOBS[job][2]()
            pull_parameters(fresh, again.url, job=job)  # the parameters as they were at the stop
            assert same(fresh.state_dict(), nets[job].state_dict()), job
        mode, _, _ = JOBS["a"]
        with Worker(
            nets["a"], again.url, mode, SGD(lr=0.05), rank=0, world_size=1, job="a", heartbeat=0
        ) as w:
            x, y = ps_job.batch(0, 3)
            F.cross_entropy(nets["a"](x), y).backward()  # type: ignore[no-untyped-call]
            assert w.step().version >= 3
            wait_for(lambda: server_stats([again.url], job="a")[0]["version"] == 4, 10, "job a's next update")
