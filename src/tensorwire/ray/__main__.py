"""The digits job on a Ray cluster, in one command: parameter servers as actors, workers as ranks,
the held-out accuracy of the servers' parameters at the end.

::

    ray job submit --address http://HEAD:8265 -- python -m tensorwire.ray --slots 2 --replicas 1 --workers 4
    python -m tensorwire.ray --address auto ...     # from a node of the cluster
    python -m tensorwire.ray                        # a Ray cluster on this machine

The last line is JSON: the servers, the slots whose backup shares its primary's node, each rank's
steps, the accuracy. ``main`` returns the accuracy (a test calls it on its own cluster).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import ray
import torch

from tensorwire.ps import digits
from tensorwire.ray.servers import start_servers
from tensorwire.ray.workers import run_workers


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tensorwire.ray", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--address", default=None, help="the Ray cluster (default: RAY_ADDRESS, else start one here)")
    add("--slots", type=int, default=2, help="parameter-server slots [2]")
    add("--replicas", type=int, default=0, help="standbys per slot, on other nodes where there are any [0]")
    add("--workers", type=int, default=2, help="training ranks [2]")
    add("--mode", default=digits.TrainConfig.mode, help=f"sync, async or ssp:N [{digits.TrainConfig.mode}]")
    add("--epochs", type=int, default=digits.TrainConfig.epochs)
    add("--capacity", default="1GiB", help="each server's store [1GiB]")
    add("--host", default=None, help="the address servers listen on [each node's Ray address]")
    add("--server-cpus", type=float, default=1.0, help="CPUs each server reserves [1]")
    add("--worker-cpus", type=float, default=1.0, help="CPUs each rank reserves [1]")
    add("--timeout", type=float, default=600.0, help="seconds the training may take [600]")
    return parser


def main(argv: Sequence[str] | None = None) -> float:
    args = _parser().parse_args(argv)
    if not ray.is_initialized():
        ray.init(address=args.address)
    config = digits.TrainConfig(mode=args.mode, epochs=args.epochs)
    with start_servers(args.slots, replicas=args.replicas, capacity=args.capacity,
                       cpus=args.server_cpus, host=args.host) as servers:  # fmt: skip
        reports = run_workers(
            _train, args.workers, servers, args=(config,), cpus=args.worker_cpus, timeout=args.timeout
        )
        accuracy = digits.evaluate(servers.address)
    ranks, steps = [r.rank for r in reports], [r.steps for r in reports]
    print(json.dumps({"servers": servers.address, "colocated": servers.colocated, "ranks": ranks,
                      "steps": steps, "accuracy": round(accuracy, 4)}))  # fmt: skip
    return accuracy


def _train(config: digits.TrainConfig) -> digits.WorkerReport:
    torch.set_num_threads(1)  # ranks share a node's cores
    return digits.train_worker(None, config)  # the servers, rank and world from the environment


if __name__ == "__main__":
    main()
