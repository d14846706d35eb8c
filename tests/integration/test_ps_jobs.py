"""Several jobs on the same parameter servers: real servers on loopback ports, workers in threads.

* two jobs with different models train at once on the same two servers, each to its own accuracy
  (sync: equal to one process at the combined batch; async: a target on held-out data);
* a worker that names a job but runs another model is refused naming the difference;
* a job ends with its last worker (its checkpoint moved aside, its memory freed), or by
  ``tensorwire ps end`` (refused while workers are live unless --force); ``keep_jobs`` keeps it;
* ``worker.barrier()``: every live worker, a worker dropped or leaving releases the others, a
  bounded wait names who has not arrived.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from tensorwire import cli
from tensorwire import transport as transports
from tensorwire._aio import run
from tensorwire.errors import LimitExceeded, ProtocolError, WaitTimeout
from tensorwire.ps import SGD, Adam, CheckpointPolicy, ParamServer, Worker
from tensorwire.ps.worker.rendezvous import JOB_ENV
from tensorwire.ps.worker.rpc import end_job, server_stats
from tensorwire.security import Security
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads, wait_for
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

W, B, STEPS = 2, 16, 60
NOWHERE = "tcp://127.0.0.1:1"  # a Worker that is never started connects to nothing
DEADLINE = 120.0
_SEEDING = threading.Lock()  # torch's global generator: workers in threads take turns


@contextlib.contextmanager
def cluster(count: int = 2, **options: object) -> Iterator[list[str]]:
    threads = [ServerThread(extensions=[ParamServer(30, **options)]) for _ in range(count)]  # type: ignore[arg-type]
    try:
        yield [t.url for t in threads]
    finally:
        for t in threads:
            t.close()


# -- two tasks, two models ---------------------------------------------------------------------------
def blobs(seed: int, dims: int, classes: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points around ``classes`` random centres: a task a small model learns in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    centres = 3 * torch.randn(classes, dims, generator=torch.Generator().manual_seed(seed // 100))
    y = torch.randint(0, classes, (n,), generator=gen)
    return centres[y] + torch.randn(n, dims, generator=gen), y


def mlp() -> torch.nn.Module:
    with _SEEDING:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))


def linear() -> torch.nn.Module:
    with _SEEDING:
        torch.manual_seed(1)
        return torch.nn.Linear(8, 3)


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


TASK_A = blobs(100, 16, 5, STEPS * W * B)  # job "mlp": sync, SGD with momentum
TEST_A = blobs(101, 16, 5, 512)
TASK_B = blobs(200, 8, 3, STEPS * W * B)  # job "linear": async, Adam
TEST_B = blobs(201, 8, 3, 512)


def rows(step: int, rank: int) -> slice:
    return slice(step * W * B + rank * B, step * W * B + (rank + 1) * B)


def train(
    net: torch.nn.Module,
    urls: list[str],
    task: tuple[torch.Tensor, torch.Tensor],
    rank: int,
    **options: object,
) -> Worker:
    x, y = task
    with Worker(net, urls, rank=rank, world_size=W, split_bytes=512, heartbeat=0, **options) as worker:  # type: ignore[arg-type]
        for step in range(STEPS):
            F.cross_entropy(net(x[rows(step, rank)]), y[rows(step, rank)]).backward()  # type: ignore[no-untyped-call]
            worker.step()
    return worker


def reference_a() -> torch.nn.Module:
    """Job A in one process at the combined batch, with plain torch.optim."""
    net, (x, y) = mlp(), TASK_A
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        batch = slice(step * W * B, (step + 1) * W * B)
        F.cross_entropy(net(x[batch]), y[batch]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return net


def test_two_jobs_with_different_models_train_at_once_on_the_same_servers() -> None:
    nets_a, nets_b = [mlp() for _ in range(W)], [linear() for _ in range(W)]
    seen: list[dict[str, object]] = []

    def work(index: int) -> None:
        rank = index % W
        if index < W:
            train(
                nets_a[rank], urls, TASK_A, rank, mode="sync", optimizer=SGD(lr=0.1, momentum=0.9), job="mlp"
            )
        else:
            train(nets_b[rank], urls, TASK_B, rank, mode="async", optimizer=Adam(lr=0.05), job="linear")

    with cluster(2) as urls:
        watcher = threading.Thread(target=lambda: seen.append(wait_both(urls)), daemon=True)
        watcher.start()
        run_threads(work, 2 * W, DEADLINE)
        watcher.join(DEADLINE)
        stats = server_stats(urls)
    assert seen and seen[0]["jobs"] == {"linear", "mlp"}  # both held at once by one server
    for doc in stats:  # each ended with its last worker; the servers hold nothing more
        assert doc["jobs"] == {} and sorted(e["job"] for e in doc["ended"]) == ["linear", "mlp"]
        assert sum(doc["held_bytes"].values()) == 0
    mlp_end = next(e for e in stats[0]["ended"] if e["job"] == "mlp")
    assert mlp_end["step"] == STEPS and mlp_end["mode"] == "sync"
    for a, b in zip(nets_a[0].parameters(), reference_a().parameters(), strict=True):
        assert float((a.detach() - b.detach()).abs().max()) <= 1e-5  # as if alone, in one process
    assert all(torch.equal(p, q) for p, q in zip(nets_a[0].parameters(), nets_a[1].parameters(), strict=True))
    assert accuracy(nets_a[0], *TEST_A) >= 0.9
    assert accuracy(nets_b[0], *TEST_B) >= 0.9 and accuracy(nets_b[1], *TEST_B) >= 0.9


def wait_both(urls: list[str]) -> dict[str, object]:
    def both() -> bool:
        return set(server_stats(urls[:1])[0]["jobs"]) == {"linear", "mlp"}

    wait_for(both, DEADLINE, "both jobs to be held", interval=0.01)
    return {"jobs": set(server_stats(urls[:1])[0]["jobs"])}


def test_a_job_is_named_by_the_worker_the_environment_or_its_model_and_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = {Worker(net, [NOWHERE], mode).job for net in (mlp(), linear()) for mode in ("sync", "async")}
    assert len(ids) == 4  # another model or mode: another job
    assert Worker(mlp(), [NOWHERE], "sync").job == Worker(mlp(), [NOWHERE], "sync").job
    assert Worker(mlp(), [NOWHERE], job="run-17").job == "run-17"
    monkeypatch.setenv(JOB_ENV, "from-env")
    assert Worker(mlp(), [NOWHERE]).job == "from-env"
    for bad in ("../up", "", "a/b", "x" * 65, "-dash", "naïve"):
        with pytest.raises(ValueError, match="job id"):
            Worker(mlp(), [NOWHERE], job=bad)


def test_a_worker_of_another_model_under_a_jobs_id_is_refused_naming_the_difference() -> None:
    with cluster(1) as urls, Worker(mlp(), urls, "sync", SGD(lr=0.1), rank=0, world_size=2, job="run"):
        other = Worker(linear(), urls, "sync", SGD(lr=0.2), rank=1, world_size=2, job="run", timeout=5)
        with pytest.raises(ProtocolError, match="job 'run' runs") as refused:
            other.start()
        said = str(refused.value)
        assert "optimizer lr 0.1 here, 0.2 asked" in said and "model's parameters" in said
        (stats,) = server_stats(urls, job="run")
        assert stats["jobs_refused"] == 1 and list(stats["workers"]) == ["0"]


def test_a_job_ends_with_its_last_worker_and_a_new_one_of_its_id_starts_afresh(tmp_path: Path) -> None:
    ps = ParamServer(30, checkpoints=CheckpointPolicy(tmp_path, every_steps=2))
    with ServerThread(extensions=[ps]) as server:
        first = linear()
        workers = [Worker(first if r == 0 else linear(), server.url, "async", rank=r, world_size=2,
                          heartbeat=0, job="j") for r in range(2)]  # fmt: skip
        for worker in workers:
            worker.start()
        first(torch.ones(2, 8)).sum().backward()  # type: ignore[no-untyped-call]
        workers[0].step()
        workers[0].close()  # one of two left: the job goes on
        assert list(server_stats([server.url])[0]["jobs"]) == ["j"]
        workers[1].close()  # the last one left: the job ends
        (stats,) = server_stats([server.url])
        assert stats["jobs"] == {} and stats["ended"][-1]["job"] == "j" and stats["version"] == 1
        assert sum(stats["held_bytes"].values()) == 0 and ps.job("j") is None
        assert (tmp_path / "_ended" / "j.1").is_dir() and not (tmp_path / "j").exists()  # its last checkpoint
        again = linear()
        with Worker(again, server.url, "async", rank=0, world_size=1, heartbeat=0, job="j") as worker:
            assert worker.version == 0  # a new job: none of the old one's updates
        assert torch.equal(again.weight, linear().weight)


def test_a_backup_records_why_each_job_ended_as_its_primary_does() -> None:
    """The replicated end carries no reason: a job its last worker left must not read, on the
    backup that may serve it next, as ended by an operator (as it once did)."""
    backup_ps = ParamServer(standby=True, peer=Security(token="peer"))
    with ServerThread(extensions=[backup_ps]) as backup:
        primary_ps = ParamServer(backups=[backup.url], peer=Security(token="peer"))
        with ServerThread(extensions=[primary_ps]) as primary:
            urls = [f"{primary.url}|{backup.url}"]
            with Worker(linear(), urls, "async", rank=0, world_size=1, heartbeat=0, job="left"):
                pass
            with Worker(linear(), urls, "async", rank=0, world_size=1, heartbeat=0, job="forced"):
                end_job([primary.url], "forced", force=True)
            records = [
                {e["job"]: e["ended"] for e in doc["ended"]}
                for doc in server_stats([primary.url, backup.url])
            ]
    assert (
        records[0]
        == records[1]
        == {
            "left": "its last worker left",
            "forced": "ended by tensorwire ps end --force",
        }
    )


def test_kept_jobs_stay_and_tensorwire_ps_end_ends_them() -> None:
    runner = CliRunner()
    with cluster(1, keep_jobs=True) as urls:
        net = linear()
        worker = Worker(net, urls, "async", rank=0, world_size=1, heartbeat=0, job="kept").start()
        net(torch.ones(2, 8)).sum().backward()  # type: ignore[no-untyped-call]
        worker.step()
        refused = runner.invoke(cli.main, ["ps", "end", "kept", *urls])
        assert refused.exit_code == 1 and "live workers (0)" in refused.output
        worker.close()
        assert server_stats(urls)[0]["jobs"]["kept"]["version"] == 1  # kept: its worker may come back
        listed = runner.invoke(cli.main, ["ps", "stats", "--jobs", *urls])
        assert listed.exit_code == 0 and "kept" in listed.output and "async" in listed.output
        with Worker(mlp(), urls, "sync", rank=0, world_size=2, heartbeat=0, job="other", timeout=5):
            status = runner.invoke(cli.main, ["status", *urls, "--json"])
            (row,) = json.loads(status.output)
            jobs = {job["job"]: job for job in row["summary"]["jobs"]}
            assert jobs["kept"] == {"job": "kept", "mode": "async", "world": 1, "live": 0, "step": 0}
            assert jobs["other"]["mode"] == "sync" and jobs["other"]["live"] == 1
            screen = runner.invoke(cli.main, ["status", *urls])
            assert "jobs" in screen.output and "other" in screen.output and "0/1" in screen.output
        ended = runner.invoke(cli.main, ["ps", "end", "kept", *urls])
        assert ended.exit_code == 0, ended.output
        assert list(server_stats(urls)[0]["jobs"]) == ["other"]  # (kept too: its worker left)
        assert runner.invoke(cli.main, ["ps", "end", "../x", *urls]).exit_code == 2  # not a job id


def test_a_forced_end_fails_its_live_workers_instead_of_restarting_the_job() -> None:
    with cluster(1) as urls:
        net = linear()
        with Worker(
            net, urls, "async", rank=0, world_size=1, heartbeat=0, job="doomed", timeout=10
        ) as worker:
            end_job(urls, "doomed", force=True)
            net(torch.ones(2, 8)).sum().backward()  # type: ignore[no-untyped-call]
            with pytest.raises(ProtocolError, match="ended by `tensorwire ps end --force`"):
                worker.step()
        assert server_stats(urls)[0]["jobs"] == {}


def test_max_jobs_refuses_a_new_job_and_changes_nothing() -> None:
    with cluster(1, max_jobs=1, keep_jobs=True) as urls:
        with Worker(linear(), urls, "async", rank=0, world_size=1, heartbeat=0, job="one"):
            pass
        late = Worker(mlp(), urls, "async", rank=0, world_size=1, heartbeat=0, job="two", timeout=5)
        with pytest.raises(LimitExceeded, match="--max-jobs"):
            late.start()
        (stats,) = server_stats(urls)
        assert list(stats["jobs"]) == ["one"] and stats["jobs_limit_refused"] == 1
        end_job(urls, "one")
        with Worker(mlp(), urls, "async", rank=0, world_size=1, heartbeat=0, job="two"):
            assert list(server_stats(urls)[0]["jobs"]) == ["two"]


# -- barriers --------------------------------------------------------------------------------------
def joined(urls: list[str], world: int, job: str, beats: tuple[float, ...] = ()) -> list[Worker]:
    """``world`` workers of ``job``, started; worker r beats every ``beats[r]`` s (default: never)."""
    workers = [Worker(linear(), urls, "async", rank=r, world_size=world, job=job,
                      heartbeat=beats[r] if r < len(beats) else 0) for r in range(world)]  # fmt: skip
    run_threads(lambda r: workers[r].start(), world, DEADLINE)
    return workers


def in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def go() -> None:
        try:
            out.append(fn())  # type: ignore[operator]
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, out


def test_a_barrier_waits_for_every_live_worker() -> None:
    with cluster(2) as urls:
        workers = joined(urls, 3, "b")
        try:
            waiting = [in_thread(workers[r].barrier) for r in (0, 1)]
            arrived = lambda: server_stats(urls[:1], job="b")[0]["barriers"] == {"0": 1, "1": 1, "2": 0}  # noqa: E731
            wait_for(arrived, 30, "workers 0 and 1 at the barrier")
            assert all(thread.is_alive() for thread, _ in waiting)  # worker 2 is not there yet
            assert workers[2].barrier() == 1
            for thread, out in waiting:
                thread.join(30)
                assert out == [1]
        finally:
            run_threads(lambda r: workers[r].close(), 3, DEADLINE)


def test_a_barrier_timeout_names_who_has_not_arrived() -> None:
    with cluster(1) as urls:
        workers = joined(urls, 2, "t")
        try:
            with pytest.raises(WaitTimeout, match=r"barrier 1 of job 't'.*not there yet: 1"):
                workers[0].barrier(timeout=0.5)
        finally:
            for worker in workers:
                worker.close()


def test_a_worker_dropped_or_leaving_releases_the_others_at_a_barrier() -> None:
    with cluster(1, heartbeat_timeout=1.0) as urls:
        workers = joined(urls, 3, "d", beats=(0.2, 0.2))  # worker 2 never beats
        try:
            waiting = [in_thread(workers[r].barrier) for r in (0, 1)]
            for thread, out in waiting:  # worker 2 is dropped after its missed heartbeats
                thread.join(30)
                assert out == [1]
            (stats,) = server_stats(urls, job="d")
            assert stats["workers_dropped"] >= 1 and not stats["workers"]["2"]["live"]
        finally:
            run_threads(lambda r: workers[r].close(), 3, DEADLINE)
    with cluster(1) as urls:
        workers = joined(urls, 2, "l")
        thread, out = in_thread(workers[0].barrier)
        wait_for(lambda: server_stats(urls, job="l")[0]["barriers"]["0"] == 1, 30, "worker 0 at the barrier")
        workers[1].close()  # it leaves: worker 0 no longer waits for it
        thread.join(30)
        assert out == [1]
        workers[0].close()


def raw(url: str, opcode: Opcode, meta: bytes) -> None:
    """One hand-made request on a connection of its own (its typed error raised)."""

    async def call() -> None:
        conn = await transports.open_channel(
            url, transports.TransportOptions(5.0, 10.0), what="a raw request"
        )
        try:
            (await conn.call(opcode, meta, what="a hand-made request")).done()
        finally:
            await conn.close()

    run(call())


def test_a_frame_without_a_job_or_with_a_bad_one_is_refused_before_anything_changes() -> None:
    with pytest.raises(ValueError, match="job id"):
        wps.PsHead(0, 1, job="a/../b").encode()
    old_head = wps.PsHead(0, 1, 0, 7).encode()[:28]  # as a worker older than jobs sends it
    bad_id = old_head + wps.JOB_TAG + bytes([6]) + b"../etc"
    with cluster(1) as urls:
        for op in (Opcode.PS_JOIN, Opcode.PS_HEARTBEAT, Opcode.PS_STATS):
            with pytest.raises(ProtocolError, match="older than this server"):
                raw(urls[0], op, old_head)
        with pytest.raises(ProtocolError, match="unusable job id"):
            raw(urls[0], Opcode.PS_JOIN, bad_id)
        with pytest.raises(ProtocolError, match="must name its job"):
            raw(urls[0], Opcode.PS_JOIN, wps.PsHead(0, 1, 0, 7).encode())
        (stats,) = server_stats(urls)
        assert stats["jobs"] == {} and stats["workers"] == {}
