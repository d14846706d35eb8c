"""The parameter server under faults: broken connections, corrupt bytes, duplicate pushes,
stopped workers, killed servers. Every fault is injected for real and checked to have fired."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ps_job
import torch

from tensorwire.ps import Adam, CheckpointPolicy, ParamServer, Worker, pull_parameters
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.security import Security, write_token_file
from tensorwire.server import ServerThread
from tensorwire.testing.faults import Fault, FaultSchedule, FaultyProxy, kill9, sigcont, sigstop
from tensorwire.testing.process import ServerProcess, run_threads, wait_for

JOB = Path(ps_job.__file__)
DEADLINE = 120.0
PEER = Security(token="the-peer-token-of-this-slot")  # what the replicas of a slot share


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def reference(tmp_path: Path, steps: int) -> dict[str, torch.Tensor]:
    """The same job, one worker, no faults."""
    out = tmp_path / "reference"
    out.mkdir()
    with ServerThread(extensions=[ParamServer()]) as server:
        ps_job.train(server.url, "sync", steps, out)
    state: dict[str, torch.Tensor] = torch.load(out / "rank0.pt", weights_only=True)
    return state


def test_a_duplicated_push_is_applied_once() -> None:
    model = ps_job.model()
    with (
        ServerThread(extensions=[ParamServer()]) as server,
        Worker(model, [server.url], "async", rank=0) as worker,
    ):
        x, y = ps_job.batch(0, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        grads = worker._tensors.take_grads()
        slot = worker._slots[0]
        first = worker._loop().call(worker._push_to(slot, grads), 10, "push")
        slot.seq, slot.clock = 0, 0  # the same (worker, seq) again, as a resend would
        again = worker._loop().call(worker._push_to(slot, grads), 10, "the same push")
        (stats,) = server_stats([server.url])
        assert first == again
        assert stats["version"] == stats["pushes_applied"] == 1
        assert stats["duplicates_ignored"] == 1 and stats["workers"]["0"]["seq"] == 1
        worker.pull()
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        assert worker.step().version == 2  # and the worker carries on with push 2


def test_dropped_connections_and_corrupt_bytes_change_nothing(tmp_path: Path) -> None:
    """Exactly once: a run whose connections break and whose bytes get corrupted (each push resent
    on a new connection) ends with the same bits as a run without faults."""
    steps = 40
    expected = reference(tmp_path, steps)
    out = tmp_path / "faulty"
    out.mkdir()
    progress = out / "rank0.progress"

    def at(step: int) -> bool:
        return progress.exists() and int(progress.read_text() or 0) >= step

    with ServerThread(extensions=[ParamServer()]) as server, FaultyProxy(server.url) as proxy:
        schedule = FaultSchedule([
            Fault("drop the connections", proxy.drop, when=lambda: at(10)),
            Fault("corrupt a byte", proxy.corrupt, when=lambda: at(20)),
            Fault("drop them again", proxy.drop, when=lambda: at(30)),
        ])  # fmt: skip
        with schedule.running():
            ps_job.train(proxy.url, "sync", steps, out)
        schedule.assert_fired()
        assert proxy.dropped >= 2 and proxy.corrupted == 1
        (stats,) = server_stats([server.url])
    assert stats["step"] == steps
    assert same_state(torch.load(out / "rank0.pt", weights_only=True), expected)


def start_workers(
    servers: list[str], mode: str, steps: int, out: Path, world: int
) -> list[subprocess.Popen[bytes]]:
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world)}
        cmd = [sys.executable, str(JOB), ",".join(servers), mode, str(steps), str(out)]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def finish(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Exit codes; any process still running after the deadline is killed (and fails the test)."""
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(DEADLINE))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            codes.append(proc.wait())
    return codes


def test_a_stopped_worker_is_dropped_and_rejoins_after_sigcont(tmp_path: Path) -> None:
    heartbeat_timeout = 2.0
    with ServerProcess(extra=["--heartbeat-timeout", str(heartbeat_timeout)]) as server:
        procs = start_workers([server.url], "sync", 300, tmp_path, 2)
        try:
            stats = lambda: server_stats([server.url])[0]  # noqa: E731
            wait_for(lambda: stats()["step"] >= 20, DEADLINE, "step 20")
            schedule = FaultSchedule([Fault("SIGSTOP worker 1", sigstop(procs[1]))])
            with schedule.running():
                schedule.wait(10)
            stopped_at = stats()["step"]
            # Worker 0 goes on alone once worker 1 missed its heartbeats: within the timeout + a step.
            wait_for(lambda: not stats()["workers"]["1"]["live"], heartbeat_timeout + 10, "worker 1 dropped")
            wait_for(lambda: stats()["step"] >= stopped_at + 5, 10, "steps without worker 1")
            resume = FaultSchedule([Fault("SIGCONT worker 1", sigcont(procs[1]))])
            with resume.running():
                resume.wait(10)
            wait_for(lambda: stats()["workers"]["1"]["live"], 30, "worker 1 to rejoin")
            schedule.assert_fired()
            resume.assert_fired()
        finally:
            codes = finish(procs)
        assert codes == [0, 0]
        assert stats()["workers_dropped"] >= 1
    report = json.loads((tmp_path / "rank1.json").read_text())
    assert report["rejoins"] >= 1


def test_killed_servers_resume_from_their_checkpoints(tmp_path: Path) -> None:
    """kill -9 both servers of a sync job mid-training, start them again on the same ports:
    each resumes from its newest checkpoint, the worker rolls them to one step and finishes."""
    every, steps = 5, 80
    dirs = [tmp_path / f"ckpt{i}" for i in range(2)]
    extra = lambda i: ["--checkpoint-dir", str(dirs[i]), "--checkpoint-every", str(every)]  # noqa: E731
    servers = [ServerProcess(extra=extra(i)) for i in range(2)]
    urls = [s.url for s in servers]
    out = tmp_path / "out"
    out.mkdir()
    procs = start_workers(urls, "sync", steps, out, 1)
    try:
        progress = out / "rank0.progress"

        def step() -> int:
            return int(progress.read_text() or 0) if progress.exists() else 0

        schedule = FaultSchedule([
            Fault("kill -9 server 0", kill9(servers[0].proc), when=lambda: step() >= 23),
            Fault("kill -9 server 1", kill9(servers[1].proc)),
        ])  # fmt: skip
        with schedule.running():
            schedule.wait(DEADLINE)
        schedule.assert_fired()
        killed_at = step()
        for s in servers:
            s.stop()
        servers = [ServerProcess(listen=url, extra=extra(i)) for i, url in enumerate(urls)]
        # What each restored: its checkpoint's version (one update a step in this sync job). Not
        # the live step: the worker rejoins as soon as both are up and trains on while this reads.
        restored = [server_stats([url])[0]["checkpoint"]["restored"] for url in urls]
        resumed = [int(name.removeprefix("ckpt-")) for name in restored]
        assert all(killed_at - every <= r <= killed_at + 1 for r in resumed), (killed_at, restored)
        assert finish(procs) == [0]
        report = json.loads((out / "rank0.json").read_text())
        assert report["rejoins"] >= 1
        final = server_stats(urls)
        assert final[0]["step"] == final[1]["step"] > killed_at
    finally:
        finish(procs)
        for s in servers:
            s.stop()


def test_fault_schedule_reports_a_fault_that_never_fired() -> None:
    never = FaultSchedule([Fault("impossible", lambda: None, when=lambda: False)], deadline=0.2)
    with never.running():
        never.wait(5)
    try:
        never.assert_fired()
    except AssertionError as exc:
        assert "impossible" in str(exc)
    else:
        raise AssertionError("a fault that never fired passed assert_fired")


def test_threads_of_the_fault_kit_end() -> None:
    before = threading.active_count()
    with ServerThread(extensions=[ParamServer()]) as server, FaultyProxy(server.url):
        pass
    wait_for(lambda: threading.active_count() <= before, 10, "the proxy's and server's threads to end")


def test_checkpoint_round_trip_restores_the_whole_job(tmp_path: Path) -> None:
    policy = CheckpointPolicy(tmp_path, every_steps=3)
    model = ps_job.model()
    original = ParamServer(checkpoints=policy, keep_jobs=True)  # kept after its worker left
    server = ServerThread(extensions=[original])
    with server, Worker(model, [server.url], "async", Adam(lr=1e-2), rank=0) as worker:
        for step in range(7):
            x, y = ps_job.batch(0, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            worker.step()
    restored = ParamServer()
    assert restored.restore(tmp_path)
    assert restored.version == original.version == 7  # the last checkpoint is written at close
    assert restored.workers[0].seq == 7 and not restored.workers[0].live
    with ServerThread(extensions=[restored]) as again:
        fresh = ps_job.model()
        pull_parameters(fresh, [again.url])
    assert same_state(fresh.state_dict(), model.state_dict())
    assert original.optimizer is not None and restored.optimizer is not None
    want, got = original.optimizer.state_dict(), restored.optimizer.state_dict()
    assert len(got["state"]) == 4 and want["param_groups"] == got["param_groups"]
    for index, entry in want["state"].items():
        assert all(torch.equal(entry[k], got["state"][index][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    (job_directory,) = tmp_path.iterdir()  # the job's own: <checkpoint dir>/<job id>
    assert job_directory.name == worker.job
    assert len(list(job_directory.iterdir())) <= 3  # the newest three are kept


def reference_sync(tmp_path: Path, steps: int, world: int) -> dict[str, torch.Tensor]:
    """The same sync job with ``world`` workers (threads), no replicas, no faults."""
    out = tmp_path / "reference"
    out.mkdir()
    with ServerThread(extensions=[ParamServer()]) as server:
        run_threads(
            lambda rank: ps_job.train(server.url, "sync", steps, out, rank=rank, world=world), world, 120
        )
    state: dict[str, torch.Tensor] = torch.load(out / "rank0.pt", weights_only=True)
    return state


def test_killing_the_primary_fails_over_to_its_backup_bit_identically(tmp_path: Path) -> None:
    """kill -9 the primary of a sync job with one backup mid-training: the backup takes over,
    the workers move to it and resend what was not acknowledged, and the job ends with the bits
    of a run without the fault."""
    steps, world = 60, 2
    expected = reference_sync(tmp_path, steps, world)
    out = tmp_path / "faulty"
    out.mkdir()
    progress = out / "rank0.progress"
    peer = ["--peer-token-file", str(write_token_file(tmp_path / "peer.token"))]
    with ServerProcess(extra=["--standby", "--failover-timeout", "1", *peer]) as backup:
        primary = ServerProcess(extra=["--backup", backup.url, *peer])
        try:
            procs = start_workers([f"{primary.url}|{backup.url}"], "sync", steps, out, world)
            try:
                at_20 = lambda: progress.exists() and int(progress.read_text() or 0) >= 20  # noqa: E731
                kill = FaultSchedule([Fault("kill -9 the primary", kill9(primary.proc), when=at_20)])
                with kill.running():
                    kill.wait(DEADLINE)
                kill.assert_fired()
                assert kill.faults[0].fired_at is not None
                killed = time.monotonic()
                wait_for(
                    lambda: server_stats([backup.url])[0]["role"] == "primary", 30, "the backup to take over"
                )
                taken_over = server_stats([backup.url])[0]["step"]
                wait_for(
                    lambda: server_stats([backup.url])[0]["step"] > taken_over, 30, "a step on the backup"
                )
                failover_s = time.monotonic() - killed
                print(f"failover: the backup took over and stepped {failover_s:.2f}s after the kill")
            finally:
                codes = finish(procs)
            assert codes == [0, 0]
        finally:
            primary.stop()
        (stats,) = server_stats([backup.url])
    assert stats["failovers"] == 1 and stats["epoch"] == 2
    assert stats["step"] == steps and stats["pushes_applied"] == steps * world  # none lost, none twice
    for rank in range(world):
        assert same_state(torch.load(out / f"rank{rank}.pt", weights_only=True), expected)


def test_a_primary_a_backup_took_over_from_is_fenced() -> None:
    from tensorwire.errors import NotPrimary

    model = ps_job.model()
    backup_ps = ParamServer(standby=True, failover_timeout=0.2, peer=PEER)
    with ServerThread(extensions=[backup_ps]) as backup:
        with ServerThread(extensions=[ParamServer(backups=[backup.url], peer=PEER)]) as primary:
            slot = f"{primary.url}|{backup.url}"
            with Worker(model, slot, "async", rank=0, heartbeat=0) as worker:
                x, y = ps_job.batch(0, 0)
                torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                worker.step()
                primary.close()  # the primary is gone: the next step moves to the backup
                torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                worker.step()
        assert backup_ps.role == "primary" and backup_ps.epoch == 2 and backup_ps.version == 2
        # The old primary comes back (at epoch 1) and serves a worker: its first change is refused.
        old = ParamServer(backups=[backup.url], peer=PEER)
        with ServerThread(extensions=[old]) as returned:
            late = Worker(ps_job.model(), returned.url, "async", rank=0, timeout=2, heartbeat=0)
            try:
                late.start()
            except NotPrimary:
                pass
            else:
                late.close()
                raise AssertionError("a fenced primary accepted a worker")
        assert old.role == "fenced"


def async_steps(worker: Worker, model: torch.nn.Module, first: int, count: int) -> None:
    """Steps ``first`` .. ``first + count - 1`` of worker 0 of ps_job, in async mode."""
    for step in range(first, first + count):
        x, y = ps_job.batch(0, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        worker.step()


def async_reference(count: int) -> torch.nn.Module:
    """The model after ``count`` async steps of one worker on one server, without faults."""
    expected = ps_job.model()
    with (
        ServerThread(extensions=[ParamServer()]) as plain,
        Worker(expected, plain.url, "async", rank=0) as worker,
    ):
        async_steps(worker, expected, 0, count)
    return expected


def test_a_restarted_backup_gets_the_job_and_can_take_over() -> None:
    """The backup dies and comes back empty on its port: the primary sends it the whole job, and
    when the primary dies in turn, the new backup takes over with the same bits."""

    expected = async_reference(9)

    model = ps_job.model()
    first_backup = ServerThread(extensions=[ParamServer(standby=True, failover_timeout=0.3, peer=PEER)])
    backup_url = first_backup.url
    primary = ServerThread(extensions=[ParamServer(backups=[backup_url], peer=PEER)])
    second_backup: ServerThread | None = None
    try:
        with Worker(model, f"{primary.url}|{backup_url}", "async", rank=0, heartbeat=0) as worker:
            async_steps(worker, model, 0, 3)
            first_backup.close()  # the backup dies; training goes on without a copy
            async_steps(worker, model, 3, 3)
            revived = ParamServer(standby=True, failover_timeout=0.3, peer=PEER)
            second_backup = ServerThread([backup_url], extensions=[revived])  # back, empty, same port
            wait_for(lambda: revived.version == 6, 30, "the state transfer to the restarted backup")
            primary.close()  # now the primary dies: the restarted backup takes over
            async_steps(worker, model, 6, 3)
            assert revived.role == "primary" and revived.version == 9
    finally:
        primary.close()
        first_backup.close()
        if second_backup is not None:
            second_backup.close()
    assert same_state(model.state_dict(), expected.state_dict())


def test_a_stopped_primary_that_comes_back_follows_the_backup_that_took_over(tmp_path: Path) -> None:
    """SIGSTOP the primary past the failover timeout: the backup takes over (epoch 2) and goes on
    without it. SIGCONT: the old primary learns of the newer epoch and follows it as its backup
    (a state transfer), so the slot can fail over again, back to it, with the bits of a run
    without faults. (Refusing the newer epoch would fence both replicas: no primary at all.)"""
    from tensorwire.ps.launch import free_port, replica_flags

    expected = async_reference(9)

    def role(url: str) -> tuple[str, int, int]:
        (doc,) = server_stats([url], timeout=5)
        return doc["role"], doc["epoch"], doc["version"]

    peer = write_token_file(tmp_path / "peer.token")
    flags = ["--failover-timeout", "0.5"]

    def pair(tries: int = 3) -> tuple[list[str], ServerProcess, ServerProcess]:
        """The replicas name each other, so their ports are picked before they listen: a port
        another test's server took meanwhile is picked again, not a failure of this test."""
        urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        started: list[ServerProcess] = []
        try:
            for i in range(2):
                started.append(ServerProcess(urls[i], extra=[*replica_flags(urls, i, peer), *flags]))
        except RuntimeError as exc:
            for server in started:
                server.stop()
            if "Address already in use" in str(exc) and tries > 1:
                return pair(tries - 1)
            raise
        return urls, started[0], started[1]

    urls, first, second = pair()
    with first, second:
        model = ps_job.model()
        with Worker(model, "|".join(urls), "async", rank=0, heartbeat=0.25, timeout=30) as worker:
            async_steps(worker, model, 0, 3)
            sigstop(first.proc)()
            try:
                async_steps(worker, model, 3, 3)  # the worker gives up on it; the backup takes over
                assert role(second.url) == ("primary", 2, 6)
            finally:
                sigcont(first.proc)()
            wait_for(lambda: role(first.url) == ("backup", 2, 6), 30, "the old primary to follow the new")
            kill9(second.proc)()
            async_steps(worker, model, 6, 3)  # and back: the old primary takes over at epoch 3
            assert role(first.url) == ("primary", 3, 9)
    assert same_state(model.state_dict(), expected.state_dict())


def _raw(url: str, opcode: int, head: bytes, timeout: float = 30.0) -> None:
    """One hand-made request on a connection of its own (its typed error raised)."""
    from tensorwire import transport as transports
    from tensorwire._aio import run
    from tensorwire.transport.frame_client import FramedTransport
    from tensorwire.types import Address

    async def call() -> None:
        conn = await transports.open_transport(Address.parse(url), transports.TransportOptions(5.0, timeout))
        try:
            assert isinstance(conn, FramedTransport)
            await conn.call(opcode, head, [], what="a hand-made request")
        finally:
            await conn.close()

    run(call())


def test_changes_waiting_behind_the_fencing_one_are_refused_too() -> None:
    """The primary's link to its backup stalls past the failover timeout: the backup takes over.
    When the link comes back, the first change the old primary forwards is refused (it is fenced);
    the changes that waited behind that one must be refused too, not made and acknowledged by a
    replica that is no longer the primary (a worker joined there only, at another step than on the
    new primary, shifted the whole run by a step)."""
    from tensorwire.errors import NotPrimary
    from tensorwire.wire import ps as wps
    from tensorwire.wire.frame import Opcode

    world = 3
    backup_ps = ParamServer(standby=True, failover_timeout=0.5, peer=PEER)
    with ServerThread(extensions=[backup_ps]) as backup, FaultyProxy(backup.url) as link:
        primary_ps = ParamServer(backups=[link.url], peer=PEER)
        with (
            ServerThread(extensions=[primary_ps]) as primary,
            Worker(ps_job.model(), primary.url, "sync", rank=0, world_size=world, heartbeat=0) as worker,
        ):
            link.pause()  # the primary's next ping (or change) waits in the link, holding the order
            wait_for(lambda: link.held >= 1, 10, "a replicated change to be held in the link")
            answers: dict[int, BaseException | None] = {}

            def join(rank: int) -> None:
                try:
                    head = wps.PsHead(rank, world, 0, 100 + rank, job=worker.job)
                    _raw(primary.url, Opcode.PS_JOIN, head.encode())
                    answers[rank] = None
                except BaseException as exc:
                    answers[rank] = exc

            joins = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in (1, 2)]
            for thread in joins:
                thread.start()

            def took_over() -> bool:
                with_head = wps.PsHead(0, world, 0, 1, job=worker.job).encode()
                try:
                    _raw(backup.url, Opcode.PS_HEARTBEAT, with_head, timeout=5)
                except NotPrimary:
                    return False
                return True

            wait_for(took_over, 30, "the backup to take over", interval=0.1)
            link.resume()  # the held change reaches the new primary: refused, the old one is fenced
            for thread in joins:
                thread.join(30)
            assert primary_ps.role == "fenced" and backup_ps.role == "primary"
            assert sorted(answers) == [1, 2]
            assert all(isinstance(answer, NotPrimary) for answer in answers.values()), answers
            assert sorted(primary_ps.workers) == [0]  # nothing the new primary does not have
            assert sorted(backup_ps.workers) == [0]
