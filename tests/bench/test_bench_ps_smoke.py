"""`tensorwire bench ps` end to end on a tiny workload: real server and worker processes."""

from __future__ import annotations

import math

from tensorwire.bench import ps as bench_ps
from tensorwire.bench.ps_baselines import Workload


def test_ps_throughput_is_measured() -> None:
    """Async here, sync in the --comm case below: each mode costs a server and two worker
    processes (~15 s of make test), and the modes differ only in the workers' flag."""
    tiny = Workload(sizes=(32, 64, 10), batch=16, steps=5, warmup=1)
    rate = bench_ps.ps_samples_per_s(tiny, "async", timeout=120)
    assert math.isfinite(rate) and rate > 0


def test_relay_pulls_are_measured_against_direct_ones() -> None:
    tiny = Workload(sizes=(32, 64, 10), batch=16, steps=3, warmup=1)
    result = bench_ps.ps_relay.measure(tiny, 1, timeout=120, children=False)  # threads: quick
    assert result["relay_fallbacks"] == 0
    assert math.isclose(result["direct_server_egress_ratio"], tiny.workers)  # every worker pulls it all
    assert 1 <= result["relay_server_egress_ratio"] < tiny.workers
    assert result["relay_vs_direct_step_time"] > 0


def test_ps_comm_measures_a_mode_against_the_socket_bound() -> None:
    tiny = [
        "--params",
        "8192",
        "--tensors",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--socket-bytes",
        "1048576",
        "--modes",
        "sync",  # the case above measures async (each mode starts its own processes)
    ]
    result = bench_ps.main(["--comm", *tiny])  # `bench ps --comm` hands over to bench/ps_comm.py
    assert result["socket_gbps"] > 0 and result["bytes_per_step"] == 2 * 2 * 4 * 8192
    assert "async" not in result
    m = result["sync"]
    assert m["ps_comm_bound_s"] == result["bytes_per_step"] / (result["socket_gbps"] * 1e9)
    assert m["ps_comm_step_s"] > 0 and m["ps_comm_efficiency"] == m["ps_comm_bound_s"] / m["ps_comm_step_s"]
