"""Gradient averaging three ways, against each other: tensorwire's exchange over tcp:// and over
gRPC, and ``torch.distributed`` all_reduce over gloo (and NCCL where every worker has a GPU).

The job: W workers (2) each hold the gradients of a model (``--bytes``, 100 MB of float32 in
``--tensors``, ~50 tensors: a weight and a bias per layer; no compute) and want their mean.
Algorithm bandwidth = gradient bytes per worker / step time (GB/s, 1e9 bytes/s). Each way is
checked before it is timed (every worker ends up with the mean in every element). The exchange
runs on S = W servers (``ExchangeClient`` with several URLs: each piece of the gradients averaged
on one of them), so that each worker's link carries the gradients once each way, as a ring
allreduce's does. Two regimes, in one run:

* **Network namespaces** (the network is the bound, as on a cluster): every worker and every
  exchange server a host of its own (``bench/netns.py``), each link shaped to ``--rate`` Gb/s (1)
  both ways. Keys ``tcp_gbps``, ``grpc_gbps``, ``gloo_gbps``, ``tcp_vs_gloo`` (target >= 1.0),
  ``grpc_vs_gloo`` (target >= 0.8), ``link_gbps`` (the link's GB/s, what a perfect allreduce's
  algorithm bandwidth would be) and ``links`` (bytes each worker's link carried per step, each
  way, measured). Needs root; skipped, with the reason in ``netns_skipped``, where it cannot be.
* **Loopback** (every byte costs CPU that all processes share): the same as ``loopback_*`` keys,
  without a target, with ``loopback_bytes``: what each worker sends and receives per step and
  what all processes send together. A server-mediated exchange moves twice the bytes of a ring
  allreduce through the same cores (each gradient goes up to a server and its mean comes down,
  where a ring's workers send each other halves), so on one machine it cannot win.

Run: ``tensorwire bench exchange [--json] [--bytes 100000000] [--steps 5] [--no-netns]``.
The workers are ``bench/exchange_ways.py``; its docstring says how each way is set up and timed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tensorwire.bench.exchange_ways import gradient_shapes
from tensorwire.bench.netns import Fabric, Unavailable
from tensorwire.bench.report import show, table
from tensorwire.ps.exchange.client import LANES
from tensorwire.ps.exchange.pieces import PIECE_BYTES
from tensorwire.server.process import ServerProcess, run_threads, wait_for

TCP_PORT, GRPC_PORT, GLOO_PORT = 7070, 7071, 29500  # in namespaces, every host has its own ports
START_TIMEOUT = 120.0  # a server or worker imports torch first; generous on a loaded 2-core machine


@dataclass(frozen=True)
class Setup:
    bytes: int = 100_000_000
    tensors: int = 50
    workers: int = 2
    servers: int = 0  # 0: as many as workers
    steps: int = 8
    warmup: int = 2
    piece_bytes: int = PIECE_BYTES
    lanes: int = LANES
    grpc_window: int = 4  # gRPC calls in flight per server
    timeout: float = 300.0

    @property
    def server_count(self) -> int:
        return self.servers or self.workers

    @property
    def grad_bytes(self) -> int:
        """What the gradients really take (the shapes round ``bytes`` down a little)."""
        return sum(4 * math.prod(shape) for _, shape in gradient_shapes(self.bytes, self.tensors))


def ways(nccl: bool = True) -> list[str]:
    """The ways this machine can run: NCCL only where every worker has a GPU of its own."""
    return ["tcp", "grpc", "gloo"] + (["nccl"] if nccl else [])


def traffic(setup: Setup, way: str) -> dict[str, float]:
    """Payload bytes per step: what one worker sends and receives, and what all processes send.
    The exchange: each worker sends its gradients up and gets the means down, and the servers send
    the means to every worker. A ring allreduce: each worker sends 2 (W - 1) / W of them."""
    n, w = setup.grad_bytes, setup.workers
    if way in ("tcp", "grpc"):
        return {"worker_sent": n, "worker_received": n, "all_processes_sent": 2 * w * n}
    ring = 2 * (w - 1) / w * n
    return {"worker_sent": ring, "worker_received": ring, "all_processes_sent": w * ring}


# -- running the workers ------------------------------------------------------------------------------
def run_workers(
    spec: dict[str, Any], wrappers: Sequence[Sequence[str]], folder: Path
) -> list[dict[str, Any]]:
    """Start one worker process per wrapper, wait for every result file; each worker's results."""
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, wrapper in enumerate(wrappers):
            cmd = [
                *wrapper,
                sys.executable,
                "-m",
                "tensorwire.bench.exchange_ways",
                str(spec_path),
                str(rank),
            ]
            with open(folder / f"worker-{rank}.log", "wb") as log:  # a file: a full pipe would stall it
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))

        def done() -> bool:
            for rank, proc in enumerate(procs):
                if proc.poll() not in (None, 0):
                    tail = (folder / f"worker-{rank}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"exchange worker {rank} exited with {proc.returncode}:\n{tail}")
            return all((folder / f"result-{r}.json").exists() for r in range(len(procs)))

        wait_for(done, START_TIMEOUT + spec["timeout"] * len(spec["ways"]), "the exchange workers", 0.05)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        return [json.loads((folder / f"result-{r}.json").read_text()) for r in range(len(procs))]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _spec(setup: Setup, way_names: list[str], **where: Any) -> dict[str, Any]:
    spec = asdict(setup)
    spec.update(world=setup.workers, ways=way_names, **where)
    return spec


def _servers(
    setup: Setup, listens: list[tuple[str, str]], wrappers: Sequence[Sequence[str]]
) -> list[ServerProcess]:
    """One exchange server per (tcp URL, gRPC host:port), started in parallel (each imports torch)."""
    servers: list[ServerProcess | None] = [None] * len(listens)

    def start(i: int) -> None:
        tcp, rpc = listens[i]
        extra = ["--grpc-listen", rpc, "--wait-timeout", str(setup.timeout)]
        servers[i] = ServerProcess(tcp, capacity="8GiB", extra=extra, wrapper=wrappers[i],
                                   start_timeout=START_TIMEOUT)  # fmt: skip

    try:
        run_threads(start, len(listens), START_TIMEOUT + 30)
    except BaseException:
        for server in servers:
            if server is not None:
                server.stop()
        raise
    return [s for s in servers if s is not None]


def loopback(setup: Setup, way_names: list[str]) -> dict[str, Any]:
    """Every process on this machine's loopback: each way's step time and algorithm bandwidth."""
    listens = [("tcp://127.0.0.1:0", "127.0.0.1:0")] * setup.server_count
    servers = _servers(setup, listens, [()] * setup.server_count)
    try:
        urls = [s.urls for s in servers]
        tcp = [next(u for u in us if u.startswith("tcp://")) for us in urls]
        rpc = [next(u for u in us if u.startswith("grpc://")).removeprefix("grpc://") for us in urls]
        # The workers' rendezvous store is held here, on a port the kernel picked and kept: a port
        # found free and handed on could be taken by another process before rank 0 bound it.
        rendezvous = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                                   timeout=timedelta(seconds=START_TIMEOUT + setup.timeout))  # fmt: skip
        spec = _spec(setup, way_names, tcp=tcp, grpc=rpc, master=f"127.0.0.1:{rendezvous.port}",
                     store_in_parent=True, ifaces=None)  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="tensorwire-exchange-") as tmp:
            results = run_workers(spec, [()] * setup.workers, Path(tmp))
        del rendezvous
    finally:
        for server in servers:
            server.stop()
    return summary(setup, way_names, results)


def namespaced(setup: Setup, way_names: list[str], rate_bits: int) -> dict[str, Any]:
    """Every server and worker a host of its own, links shaped to ``rate_bits``."""
    s, w = setup.server_count, setup.workers
    with (
        Fabric(s + w, rate_bits) as fabric,
        tempfile.TemporaryDirectory(prefix="tensorwire-exchange-") as tmp,
    ):
        hosts = fabric.addresses
        listens = [(f"tcp://{hosts[i]}:{TCP_PORT}", f"{hosts[i]}:{GRPC_PORT}") for i in range(s)]
        servers = _servers(setup, listens, [fabric.wrapper(i) for i in range(s)])
        try:
            ifaces = [fabric.inside(s + r) for r in range(w)]
            spec = _spec(setup, way_names, tcp=[t for t, _ in listens], grpc=[g for _, g in listens],
                         master=f"{hosts[s]}:{GLOO_PORT}", ifaces=ifaces)  # fmt: skip
            results = run_workers(spec, [fabric.wrapper(s + r) for r in range(w)], Path(tmp))
        finally:
            for server in servers:
                server.stop()
    return summary(setup, way_names, results)


def summary(setup: Setup, way_names: list[str], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per way: the slowest worker's step time, the algorithm bandwidth, the bytes each worker's
    link carried per step (in namespaces)."""
    out: dict[str, Any] = {"links": {}}
    for way in way_names:
        step = max(r[way]["step_s"] for r in results)
        out[f"{way}_step_s"] = step
        out[f"{way}_gbps"] = setup.grad_bytes / step / 1e9
        if "link_sent" in results[0][way]:
            out["links"][way] = {
                key: statistics.mean(r[way][f"link_{side}"] for r in results)
                for key, side in (("worker_sent", "sent"), ("worker_received", "received"))
            }
    for way in ("tcp", "grpc"):
        if way in way_names and "gloo" in way_names:
            out[f"{way}_vs_gloo"] = out[f"{way}_gbps"] / out["gloo_gbps"]
    if not out["links"]:
        del out["links"]
    return out


# -- the command ------------------------------------------------------------------------------------
def run(setup: Setup, *, netns: bool, loop: bool, rate_gbit: float) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tensors = len(gradient_shapes(setup.bytes, setup.tensors))
    result: dict[str, Any] = {"grad_bytes": setup.grad_bytes, "tensors": tensors,
                              "workers": setup.workers, "servers": setup.server_count, "steps": setup.steps,
                              "piece_bytes": setup.piece_bytes, "lanes": setup.lanes}  # fmt: skip
    if netns:
        rate = int(rate_gbit * 1e9)
        result.update(rate_gbit=rate_gbit, link_gbps=rate / 8 / 1e9)
        try:
            result.update(namespaced(setup, ways(nccl=False), rate))
        except Unavailable as exc:
            result["netns_skipped"] = f"network namespaces are not available here: {exc}"
    if loop:
        measured = loopback(setup, ways(nccl=gpus >= setup.workers))
        result.update({f"loopback_{k}": v for k, v in measured.items()})
        result["loopback_bytes"] = {way: traffic(setup, way) for way in ways(nccl=False)}
        if gpus < setup.workers:
            result["loopback_nccl_skipped"] = f"{gpus} GPU(s) for {setup.workers} workers"
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    d = Setup()
    parser = argparse.ArgumentParser(prog="tensorwire bench exchange", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--bytes", type=int, default=d.bytes, help="gradient bytes per worker")
    parser.add_argument("--tensors", type=int, default=d.tensors, help="how many tensors they are in")
    parser.add_argument("--workers", type=int, default=d.workers)
    parser.add_argument("--servers", type=int, default=d.servers, help="exchange servers (0: one per worker)")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per way")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first")
    parser.add_argument("--piece-bytes", type=int, default=d.piece_bytes, help="the exchange's piece size")
    parser.add_argument("--lanes", type=int, default=d.lanes, help="exchange connections per server")
    parser.add_argument(
        "--grpc-window", type=int, default=d.grpc_window, help="gRPC calls in flight per server"
    )
    parser.add_argument("--rate", type=float, default=1.0, help="namespaces: link speed in Gb/s")
    parser.add_argument("--timeout", type=float, default=d.timeout, help="seconds for each way")
    parser.add_argument("--no-netns", dest="netns", action="store_false", help="loopback only")
    parser.add_argument("--no-loopback", dest="loop", action="store_false", help="namespaces only")
    args = parser.parse_args(argv)
    setup = Setup(args.bytes, args.tensors, args.workers, args.servers, args.steps, args.warmup,
                  args.piece_bytes, args.lanes, args.grpc_window, args.timeout)  # fmt: skip
    return show(run(setup, netns=args.netns, loop=args.loop, rate_gbit=args.rate), args.json, _readable)


def _readable(r: dict[str, Any]) -> str:
    head = (f"gradient exchange: {r['grad_bytes'] / 1e6:.0f} MB in {r['tensors']} tensors, "
            f"{r['workers']} workers, {r['servers']} servers; algorithm bandwidth, GB/s")  # fmt: skip
    rows = []
    for prefix, where in (("", f"{r.get('rate_gbit', '?')} Gb/s links"), ("loopback_", "loopback")):
        for way, label in (("tcp", "exchange, tcp"), ("grpc", "exchange, gRPC"), ("gloo", "gloo all_reduce"),
                           ("nccl", "NCCL all_reduce")):  # fmt: skip
            value = r.get(f"{prefix}{way}_gbps")
            if value is not None:
                vs = r.get(f"{prefix}{way}_vs_gloo")
                rows.append((f"{label} ({where})", f"{value:.3f}", f"{vs:.2f} x gloo" if vs else ""))
    if "netns_skipped" in r:
        rows.append(("namespaces", "skipped", r["netns_skipped"]))
    return table(head, rows or [("nothing", "", "measured")], 8)


if __name__ == "__main__":
    main()
