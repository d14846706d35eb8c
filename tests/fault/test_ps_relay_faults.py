"""Relay pulls (``ps.Worker(pull="relay")``) under faults: a worker of the chain killed mid-job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import ps_job
import torch

from tensorwire.testing.faults import Fault, FaultSchedule, kill9
from tensorwire.testing.process import ServerProcess

JOB = Path(ps_job.__file__)
STEPS, WORLD, VICTIM = 40, 3, 1


def test_a_worker_killed_mid_job_is_routed_around_and_the_others_finish(tmp_path: Path) -> None:
    """kill -9 worker 1 (a process) of a sync job of three relay-pulling workers (the others
    threads here) at step 5: the server drops it after missed heartbeats, the chains route around
    it, and the others train to the end with the same parameters, still through the relay."""
    with ServerProcess(extra=["--heartbeat-timeout", "1.5"]) as server:
        env = {**os.environ, "RANK": str(VICTIM), "WORLD_SIZE": str(WORLD)}
        cmd = [sys.executable, str(JOB), server.url, "sync", str(STEPS), str(tmp_path), "relay"]
        victim = subprocess.Popen(cmd, env=env)
        try:
            errors: list[BaseException] = []

            def survivor(rank: int) -> None:
                try:
                    ps_job.train(server.url, "sync", STEPS, tmp_path, rank=rank, world=WORLD, pull="relay")
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=survivor, args=(r,)) for r in (0, 2)]
            for thread in threads:
                thread.start()
            progress = tmp_path / f"rank{VICTIM}.progress"
            at_5 = lambda: progress.exists() and int(progress.read_text() or 0) >= 5  # noqa: E731
            kill = FaultSchedule([Fault("kill -9 worker 1", kill9(victim), when=at_5)], deadline=60)
            with kill.running():
                kill.wait(60)
            kill.assert_fired()
            for thread in threads:
                thread.join(90)
            assert not any(t.is_alive() for t in threads), "the survivors did not finish"
            assert not errors, errors
        finally:
            victim.kill()
            assert victim.wait(10) == -9
    states = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 2)]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    for rank in (0, 2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["relay_pulls"] + report["relay_fallbacks"] == STEPS + 1 + report["rejoins"]
        assert report["relay_pulls"] >= STEPS - 5, report  # the relay went on after the kill
