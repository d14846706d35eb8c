"""`tensorwire bench chaos`, briefly: real replicated servers and workers, killed and restarted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tensorwire.bench import chaos
from tensorwire.server.process import ServerProcess

# Past the benchmark's own 120 s wait for a failover (bench/chaos.py), whose error says what each
# server reports (role, epoch, step): the suite's 120 s would end the test first, saying nothing.
CHAOS_TIMEOUT = 300


@pytest.mark.timeout(CHAOS_TIMEOUT)
def test_a_short_chaos_run_loses_and_doubles_nothing() -> None:
    result = chaos.run(steps=300, interval=1.5, seed=1)
    assert result["faults_injected"] >= 1
    assert result["lost_updates"] == 0 and result["duplicate_updates"] == 0
    assert result["loss"] > 0


def test_a_worker_reports_its_step_once_it_has_joined_before_any_step(tmp_path: Path) -> None:
    """A worker started again late may join at the job's last step and leave at once, ending the
    job: its report must say so before it leaves, or the controller, reading its last life's step,
    may kill it and start it again into a fresh job that waits forever (a flake of this smoke
    test). Here the job has no steps: each worker joins at 0 and leaves."""
    (tmp_path / "rank1.json").write_text(json.dumps({"step": 7, "seqs": [3], "acked": 3}))  # a last life
    with ServerProcess() as server:
        cmd = [sys.executable, "-m", "tensorwire.bench.chaos", "--worker", server.url, "0", str(tmp_path)]
        procs = [
            subprocess.Popen(cmd, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"}) for rank in (0, 1)
        ]
        try:
            assert [p.wait(timeout=120) for p in procs] == [0, 0]
        finally:
            for p in procs:
                p.kill()
                p.wait()
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["step"] for r in reports] == [0, 0]
    assert reports[0]["seqs"] == [0] and reports[1]["seqs"] == [3]  # an acknowledged push stays counted


@pytest.mark.timeout(CHAOS_TIMEOUT)
def test_with_a_token_on_every_server_the_replicas_still_hold_every_update() -> None:
    """`bench chaos --token`: every server requires a client token, so the replicas must reach each
    other with their peer token; a primary that could not would lose acknowledged updates at the
    failover (each fault here kills a primary)."""
    result = chaos.run(steps=250, interval=1.5, seed=2, token=True, primaries=True)
    assert result["faults_injected"] >= 1 and len(result["failovers"]) == result["faults_injected"]
    assert result["lost_updates"] == 0 and result["duplicate_updates"] == 0


@pytest.mark.timeout(CHAOS_TIMEOUT)
def test_with_etcd_leases_a_killed_or_stopped_primary_hands_over_and_nothing_is_lost() -> None:
    """`bench chaos --coordinator etcd`: each slot's primary holds a lease in an etcd of the run's
    own; every fault fails a primary, a partition first (SIGSTOP past the ttl, then SIGCONT: it
    must step down and follow), then a kill. The backup takes over only once the lease is gone."""
    pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")
    if shutil.which("etcd") is None:
        pytest.skip("etcd not on PATH (apt-get install etcd-server)")
    result = chaos.run(steps=600, interval=1.5, seed=3, primaries=True, coordinator="etcd", lease_ttl=2)
    assert result["faults_injected"] >= 1 and len(result["failovers"]) == result["faults_injected"]
    assert result["failovers"][0]["kind"] == "partition"
    assert all(f["seconds"] > 0 for f in result["failovers"])
    # Each failover measured the end of the failed primary's lease, which its next step follows.
    assert all(f["lease_s"] is not None and f["lease_s"] <= f["seconds"] for f in result["failovers"])
    assert result["lost_updates"] == 0 and result["duplicate_updates"] == 0
