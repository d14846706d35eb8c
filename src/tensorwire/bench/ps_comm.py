"""The parameter server's communication against the bound the machine sets (``bench ps --comm``).

A large model (``--params``, 64M float32 parameters in ``--tensors`` tensors, SGD) goes through 2
servers and 2 workers on loopback with no compute at all: each step every worker hands over a
gradient for every parameter and calls ``Worker.step()`` (push, then pull), in ``sync`` and in
``async`` mode. What bounds such a step on one machine is the CPU that moves the bytes: every byte
a process sends costs a send and a receive on the same cores, whoever sends it. So the bound is all
bytes sent by all processes in one step (each worker pushes the model's bytes and pulls them back;
the servers send the pulls: 2 x workers x model bytes) over ``socket_gbps``, one plain socket
stream (``sendall`` of a tensor's bytes, ``--socket-bytes``, 256 MiB, into ``recv_into`` another,
the sender and receiver each a process, which keeps both cores busy) measured in the same run.

Keys, for each mode (``sync``, ``async``): ``ps_comm_step_s`` (the slowest worker's median step),
``ps_comm_bound_s`` and ``ps_comm_efficiency`` = bound / measured (target >= 0.8); and
``socket_gbps``, ``bytes_per_step``.

Run: ``tensorwire bench ps --comm [--json] [--params 67108864] [--steps 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorwire.bench import ps_baselines as base
from tensorwire.bench.children import Child, spawned
from tensorwire.bench.report import show, table
from tensorwire.bench.transfer import socket_baseline, socket_sink
from tensorwire.ps import SGD, Worker
from tensorwire.ps.launch import local_servers

SERVERS = 2
WORKERS = 2
MODES = ("sync", "async")
SOCKET_BYTES = 256 << 20  # the plain stream's transfer: as large as a default model's push


@dataclass(frozen=True)
class Setup:
    params: int = 64 << 20
    tensors: int = 16
    steps: int = 5
    warmup: int = 2
    timeout: float = 300.0
    socket_bytes: int = SOCKET_BYTES

    @property
    def sizes(self) -> list[int]:
        """Elements of each tensor (the first ones take the remainder)."""
        per, extra = divmod(self.params, self.tensors)
        return [per + (i < extra) for i in range(self.tensors)]

    @property
    def bytes_per_step(self) -> int:
        """All bytes all processes send in one step: each worker pushes the model and the servers
        send it back to each worker's pull."""
        return 2 * WORKERS * 4 * self.params


def model(setup: Setup) -> torch.nn.Module:
    module = torch.nn.Module()
    module.params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for n in setup.sizes)
    return module


def _worker(setup: Setup, rank: int, urls: list[str], mode: str) -> list[float]:
    """One worker (a child process): warm up, then time each step; its step times."""
    torch.set_num_threads(1)
    net = model(setup)
    grads = [torch.full_like(p, 1e-3) for p in net.parameters()]  # handed over, never changed
    times = []
    with Worker(net, urls, mode, SGD(lr=0.1), rank=rank, world_size=WORKERS, timeout=setup.timeout) as worker:
        for i in range(setup.warmup + setup.steps):
            start = time.perf_counter()
            for param, grad in zip(net.parameters(), grads, strict=True):
                param.grad = grad
            worker.step()
            if i >= setup.warmup:
                times.append(time.perf_counter() - start)
    return times


def step_s(setup: Setup, mode: str) -> float:
    """The slowest worker's median step through fresh servers in ``mode``."""
    with local_servers(SERVERS) as urls:
        jobs: list[base.Job] = [(f"ps worker {r}", _worker, (setup, r, urls, mode)) for r in range(WORKERS)]
        results = base.run_children(f"tensorwire {mode} workers", jobs, setup.timeout)
    return max(float(statistics.median(times)) for times in results if isinstance(times, list))


def socket_gbps(nbytes: int = SOCKET_BYTES, iters: int = 3) -> float:
    """One plain socket stream between two processes (GB/s): the bound's rate."""
    data = torch.rand(nbytes // 4)
    with spawned() as children:
        children.append(Child(socket_sink, data.numel() * 4))
        port = children[0].ready()
        assert isinstance(port, int)
        return socket_baseline(port, data, iters)


def run(setup: Setup, modes: Sequence[str] = MODES) -> dict[str, Any]:
    rate = socket_gbps(setup.socket_bytes)
    bound = setup.bytes_per_step / (rate * 1e9)
    result: dict[str, Any] = {"params": setup.params, "tensors": setup.tensors, "servers": SERVERS,
                              "workers": WORKERS, "steps": setup.steps, "socket_gbps": rate,
                              "bytes_per_step": setup.bytes_per_step}  # fmt: skip
    for mode in modes:
        measured = step_s(setup, mode)
        result[mode] = {
            "ps_comm_step_s": measured,
            "ps_comm_bound_s": bound,
            "ps_comm_efficiency": bound / measured,
        }
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    d = Setup()
    parser = argparse.ArgumentParser(prog="tensorwire bench ps --comm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--comm", action="store_true", help=argparse.SUPPRESS)  # what `bench ps` passes on
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--params", type=int, default=d.params, help="float32 parameters of the model")
    parser.add_argument("--tensors", type=int, default=d.tensors, help="how many tensors they are in")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: sync, async")
    parser.add_argument("--timeout", type=float, default=d.timeout, help="seconds for each mode")
    parser.add_argument(
        "--socket-bytes", type=int, default=d.socket_bytes, help="the plain stream's transfer"
    )
    args = parser.parse_args(argv)
    setup = Setup(args.params, args.tensors, args.steps, args.warmup, args.timeout, args.socket_bytes)
    return show(run(setup, args.modes.split(",")), args.json, _readable)


def _readable(r: dict[str, Any]) -> str:
    head = (f"parameter server push + pull, {r['params']:,} float32 parameters, {r['servers']} servers, "
            f"{r['workers']} workers, loopback; bound = {r['bytes_per_step'] / 1e6:,.0f} MB sent per step "
            f"/ one socket stream's {r['socket_gbps']:.2f} GB/s")  # fmt: skip
    rows = []
    for mode in (m for m in MODES if m in r):
        m = r[mode]
        note = f"bound {m['ps_comm_bound_s']:.3f} s, efficiency {m['ps_comm_efficiency']:.2f} (target >= 0.8)"
        rows.append((mode, f"{m['ps_comm_step_s']:.3f} s", note))
    return table(head, rows, 9)


if __name__ == "__main__":
    main()
