"""Servers restored from checkpoints of different steps are rolled back to the older one by the
worker that rejoins them (it joined them first, so it leaves the ones ahead before it asks: a
server rolls back only with no worker live). Before, the rollback was refused ("cannot roll back
while workers [0] are live") and the worker failed whenever a kill left its servers' newest
checkpoints a step interval apart."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ps_job
import torch

from tensorwire.ps import SGD, CheckpointPolicy, ParamServer, Worker
from tensorwire.server import ServerThread
from tensorwire.testing.process import param_server_of


def train(model: torch.nn.Module, urls: list[str], first: int, steps: int) -> None:
    with Worker(model, urls, "sync", SGD(lr=0.05), rank=0, world_size=1, heartbeat=0) as worker:
        for step in range(first, first + steps):
            x, y = ps_job.batch(0, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            worker.step()


def restored_a_checkpoint_apart(
    tmp_path: Path, every_steps: int, train_on: Callable[[list[str]], None]
) -> tuple[list[ParamServer], list[Path]]:
    """Two servers checkpointing every ``every_steps`` steps, trained by ``train_on(urls)``, then
    restored from their checkpoints after server b lost its newest one (killed before it wrote
    it): the restored ParamServers, not serving yet, and the two checkpoint directories."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    policies = [CheckpointPolicy(d, every_steps=every_steps) for d in dirs]
    # The servers keep the job when its workers leave (as after a crash of the servers).
    servers = [ServerThread(extensions=[ParamServer(checkpoints=p, keep_jobs=True)]) for p in policies]
    with servers[0], servers[1]:
        train_on([s.url for s in servers])
    (job_directory,) = dirs[1].iterdir()  # <checkpoint dir>/<job id>
    shutil.rmtree(sorted(job_directory.iterdir())[-1])
    restored = [ParamServer(checkpoints=p) for p in policies]
    assert [r.restore(p.directory) for r, p in zip(restored, policies, strict=True)] == [True, True]
    return restored, dirs


def test_servers_restored_a_checkpoint_apart_are_rolled_back_to_one_step(tmp_path: Path) -> None:
    model = ps_job.model()
    restored, _ = restored_a_checkpoint_apart(tmp_path, 5, lambda urls: train(model, urls, 0, 10))
    assert [r.step for r in restored] == [10, 5]  # b comes back at step 5
    with ServerThread(extensions=[restored[0]]) as a, ServerThread(extensions=[restored[1]]) as b:
        train(model, [a.url, b.url], 5, 3)
        assert restored[0].step == restored[1].step == 8


def _train_until(model: torch.nn.Module, urls: list[str], rank: int, until: int) -> None:
    """One of two sync workers: steps until the job reaches ``until`` (as the chaos benchmark's)."""
    sgd = SGD(lr=0.05)
    with Worker(model, urls, "sync", sgd, rank=rank, world_size=2, heartbeat=0, timeout=60) as worker:
        while worker.clock < until:
            x, y = ps_job.batch(rank, worker.clock)
            torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            worker.step()


def _two_workers(urls: list[str], until: int, second_starts: Callable[[], bool]) -> None:
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            _train_until(ps_job.model(), urls, rank, until)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    first = threading.Thread(target=run, args=(1,))
    first.start()
    deadline = time.monotonic() + 30
    while not second_starts() and time.monotonic() < deadline and first.is_alive():
        time.sleep(0.005)
    second = threading.Thread(target=run, args=(0,))
    second.start()
    first.join(120)
    second.join(120)
    assert not first.is_alive() and not second.is_alive()
    assert not errors, errors


def test_two_workers_that_rejoin_servers_a_checkpoint_apart_both_go_on(tmp_path: Path) -> None:
    """The chaos benchmark's rare failure: two workers rejoin servers restored a checkpoint apart,
    the second once the first is live on the server ahead. Each finds the other live there when it
    asks for the rollback: a refusal that says someone else is live is a reason to look again, not
    to fail, and the servers end at one step."""
    restored, _ = restored_a_checkpoint_apart(tmp_path, 5, lambda urls: _two_workers(urls, 10, lambda: True))
    assert [r.step for r in restored] == [10, 5]
    with ServerThread(extensions=[restored[0]]) as a, ServerThread(extensions=[restored[1]]) as b:
        _two_workers([a.url, b.url], 12, lambda: 1 in restored[0].sole.members.live())
        assert restored[0].step == restored[1].step


def test_servers_a_step_apart_with_nothing_to_go_back_to_meet_at_the_later_step(tmp_path: Path) -> None:
    """Every worker dropped from one server mid-step while the other took the step (the chaos
    benchmark's partitions) leaves them a step apart with no checkpoint to go back to: the one
    behind takes that step empty, as a step whose workers were all dropped, instead of the
    workers failing at their timeout with "the servers could not be brought to one step"."""
    model = ps_job.model()
    restored, dirs = restored_a_checkpoint_apart(tmp_path, 1, lambda urls: train(model, urls, 0, 10))
    assert [r.step for r in restored] == [10, 9]  # b comes back a step behind
    shutil.rmtree(dirs[0])  # and a keeps nothing to go back to
    with ServerThread(extensions=[restored[0]]) as a, ServerThread(extensions=[restored[1]]) as b:
        train(model, [a.url, b.url], 10, 2)
        assert restored[0].step == restored[1].step == 12


def test_a_step_taken_empty_is_not_taken_twice(tmp_path: Path) -> None:
    """A one-step-forward rollback is checked (the job at ``clock - 1``) before it waits for its
    turn in the order of changes; a step taken meanwhile must not be followed by a second, empty
    one: ``skip_step`` looks again under the step lock."""
    model = ps_job.model()
    with ServerThread(extensions=[ParamServer(keep_jobs=True)]) as server:
        train(model, [server.url], 0, 3)
        run = param_server_of(server).sole
        assert run.job.step == 3
        server._thread.call(run.consistency.skip_step(2), 10, "a stale skip")
        assert (run.job.step, run.job.version) == (3, 3)  # the job was past step 2: nothing
        server._thread.call(run.consistency.skip_step(3), 10, "a skip of the current step")
        assert (run.job.step, run.job.version) == (4, 4)
