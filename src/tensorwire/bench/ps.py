"""Parameter-server benchmark: tensorwire's PS next to what PyTorch offers for the same job.

One workload (``ps_baselines.Workload``: a ~10.5M-parameter MLP on synthetic data, SGD, 2 workers
at batch 64, one torch thread per process) trained four ways, in one run, so the ratios compare
runs on the same machine in the same minute:

* ``ps_sync``: 2 tensorwire parameter servers + 2 workers (4 processes), ``mode="sync"``.
* ``ps_async``: the same, ``mode="async"``.
* ``rpc_ps``: the ``torch.distributed.rpc`` batch-update parameter server (1 server + 2 trainers).
* ``ddp``: ``DistributedDataParallel`` over gloo (2 processes).
* relay pulls (``bench/ps_relay.py``): ``ps_sync`` again with ``pull="direct"`` and ``pull="relay"``:
  ``relay_server_egress_ratio`` (what the servers sent per version over the parameter bytes; direct,
  ``direct_server_egress_ratio``, is about the number of workers) and ``relay_vs_direct_step_time``.

Targets (issue 4): ``async_vs_rpc`` = ps_async / rpc_ps >= 2; ``sync_step_vs_ddp`` = the sync step
time over DDP's = ddp / ps_sync samples/s <= 1.3.

Run: ``tensorwire bench ps [--json] [--steps 30] [--sizes 1024,2048,2048,2048,10]``.
``tensorwire bench ps --comm`` measures something else: the push and pull of a large model with no
compute, against the bound the machine sets (``bench/ps_comm.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from tensorwire.bench import ps_baselines as base
from tensorwire.bench import ps_comm, ps_relay
from tensorwire.bench.report import show
from tensorwire.ps.launch import local_servers

SERVERS = 2


def _ps_worker(w: base.Workload, rank: int, urls: list[str], mode: str, timeout: float) -> float:
    """Train one worker through the servers; the seconds its timed steps took."""
    return ps_relay.train(w, rank, urls, mode, timeout)[0]


def ps_samples_per_s(w: base.Workload, mode: str, timeout: float = 300.0) -> float:
    """Samples/s of ``w`` through ``SERVERS`` fresh tensorwire servers in ``mode``."""
    with local_servers(SERVERS) as urls:
        jobs: list[base.Job] = [
            (f"ps worker {rank}", _ps_worker, (w, rank, urls, mode, timeout)) for rank in range(w.workers)
        ]
        return base.samples_per_s(w, base.run_children(f"tensorwire {mode} workers", jobs, timeout))


def run(w: base.Workload, timeout: float) -> dict[str, float | int]:
    result: dict[str, float | int] = {"params": base.param_count(w), "workers": w.workers, "servers": SERVERS}
    result["ps_sync_samples_per_s"] = ps_samples_per_s(w, "sync", timeout)
    result["ps_async_samples_per_s"] = ps_samples_per_s(w, "async", timeout)
    result["rpc_ps_samples_per_s"] = base.rpc_ps_samples_per_s(w, timeout)
    result["ddp_samples_per_s"] = base.ddp_samples_per_s(w, timeout)
    result["async_vs_rpc"] = result["ps_async_samples_per_s"] / result["rpc_ps_samples_per_s"]
    result["sync_vs_rpc"] = result["ps_sync_samples_per_s"] / result["rpc_ps_samples_per_s"]
    result["sync_step_vs_ddp"] = result["ddp_samples_per_s"] / result["ps_sync_samples_per_s"]
    result |= ps_relay.measure(w, SERVERS, timeout)  # sync pulls through the relay vs direct
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if "--comm" in args_in:  # the communication benchmark, with its own options
        return ps_comm.main(args_in)
    default = base.Workload()
    parser = argparse.ArgumentParser(prog="tensorwire bench ps", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument(
        "--comm",
        action="store_true",
        help="instead: push + pull of a large model against the machine's bound (ps_comm.py)",
    )
    parser.add_argument("--sizes", type=base._sizes, default=default.sizes, help="MLP widths")
    parser.add_argument("--batch", type=int, default=default.batch, help="samples per worker per step")
    parser.add_argument("--steps", type=int, default=default.steps, help="timed steps")
    parser.add_argument("--warmup", type=int, default=default.warmup, help="untimed steps first")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each of the four runs")
    args = parser.parse_args(argv)
    w = base.Workload(args.sizes, args.batch, args.steps, args.warmup)
    result = run(w, args.timeout)
    return show(result, args.json, _print)


def _print(result: dict[str, float | int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"parameter server, {result['params']:,} parameters, {result['workers']} workers")
    table.add_column("path")
    table.add_column("samples/s", justify="right")
    for key, label in (("ps_sync", "tensorwire PS, sync (2 servers)"), ("ps_async", "tensorwire PS, async"),
                       ("rpc_ps", "torch.distributed.rpc PS"), ("ddp", "DDP over gloo")):  # fmt: skip
        table.add_row(label, f"{result[f'{key}samples_per_s']:,.0f}")
    Console().print(table)
    print(f"async / rpc PS = {result['async_vs_rpc']:.2f} (target >= 2); "
          f"sync step time / DDP's = {result['sync_step_vs_ddp']:.2f} (target <= 1.3)")  # fmt: skip
    print(f"server egress per version / parameter bytes: direct {result['direct_server_egress_ratio']:.2f}, "
          f"relay {result['relay_server_egress_ratio']:.2f}; relay / direct step time "
          f"{result['relay_vs_direct_step_time']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
