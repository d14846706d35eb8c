"""`tensorwire bench ps` end to end on a tiny workload: real server and worker processes."""

from __future__ import annotations

import math

from tensorwire.bench import ps as bench_ps
from tensorwire.bench.ps_baselines import Workload


def test_ps_throughput_is_measured_in_both_modes() -> None:
    tiny = Workload(sizes=(32, 64, 10), batch=16, steps=5, warmup=1)
    for mode in ("sync", "async"):
        rate = bench_ps.ps_samples_per_s(tiny, mode, timeout=120)
        assert math.isfinite(rate) and rate > 0, mode
