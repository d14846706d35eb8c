"""Sweep benchmark: bandwidth by tensor size, latency percentiles, CPU per GB and peak memory,
for every transport and the peers it should be judged against, in one run.

For each entry of ``TRANSPORTS`` a server runs in a child process (``memory://`` in the client's
own process: that is what it is) and a client in another child, pinned to separate CPUs as in
``transfer.py``. The client measures, and reports:

* ``<transport> put`` / ``<transport> get``: GB/s of ``put`` and ``get(out=...)`` at each size
  from 4 KiB up to ``--max-size`` (powers of 4), median of as many runs as fit ``--budget`` bytes
  (at least 3, at most 200, after a warm-up);
* p50 / p90 / p99 of a 4 KiB ``get``, in microseconds;
* CPU seconds per GB moved (put and get of ``--cpu-size`` tensors), of the client and of the
  server process, from their own CPU times (psutil, user + system);
* peak resident memory of each process (the kernel's high-water mark, VmHWM, read through /proc;
  current RSS from psutil where there is no /proc).

Peers, measured the same way in the same run: ``socket send`` (a plain socket, ``sendall`` of the
tensor's bytes, ``recv_into`` a preallocated buffer, a one-byte ack: the Python TCP ceiling), a
4 KiB socket echo for latency (both with TCP_NODELAY, as asyncio and tensorwire set it), and
``memcpy`` (``copy_`` into a preallocated tensor: the ceiling of any same-host path). A transport
added to ``TRANSPORTS`` (``shm://``, say) is one line.

Run: ``tensorwire bench sweep [--max-size 256MiB] [--json]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import torch

import tensorwire
from tensorwire.bench.children import (
    Child,
    Cpus,
    add_run_options,
    cpu_seconds,
    placement,
    recv_exactly,
    spawned,
    starting,
)
from tensorwire.bench.report import show
from tensorwire.bench.transfer import _serve_tensorwire, parse_size
from tensorwire.transport import rdma_engine
from tensorwire.types import KiB, MiB
from tensorwire.wire.tensors import byte_view

MIN_SIZE = 4 * KiB
LATENCY_BYTES = 4 * KiB
MIN_ITERS, MAX_ITERS = 3, 200
Result = dict[str, Any]


@dataclass(frozen=True)
class Transport:
    """One transport of the sweep: its name and what its server listens on."""

    name: str
    listen: str
    in_process: bool = False  # the server runs in the client's process (memory://)


TRANSPORTS: list[Transport] = [
    Transport("tcp", "tcp://127.0.0.1:0"),
    Transport("grpc", "grpc://127.0.0.1:0"),
    Transport("shm", "shm://127.0.0.1:0"),
    Transport("rdma", "rdma://127.0.0.1:0"),  # skipped, with the reason, where the engine cannot run
    Transport("memory", "memory://bench-sweep", in_process=True),
]


@dataclass(frozen=True)
class Plan:
    """What each client child measures."""

    sizes: tuple[int, ...]
    budget: int  # bytes per size and direction
    latency_iters: int
    cpu_size: int
    cpu_iters: int

    def iters(self, size: int) -> int:
        return max(MIN_ITERS, min(MAX_ITERS, self.budget // size))


def sizes_up_to(max_size: int) -> tuple[int, ...]:
    sizes, size = [], MIN_SIZE
    while size <= max_size:
        sizes.append(size)
        size *= 4
    return tuple(sizes)


# -- measuring processes ---------------------------------------------------------------------------
def peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (VmHWM), or its current RSS without /proc."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def _median_s(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def _cpu_per_gb(pids: Sequence[int], nbytes: int, run: Callable[[], None]) -> list[float]:
    """CPU seconds per GB moved of each process in ``pids`` while ``run`` moves ``nbytes``."""
    before = [cpu_seconds(pid) for pid in pids]
    run()
    return [(cpu_seconds(pid) - b) / (nbytes / 1e9) for pid, b in zip(pids, before, strict=True)]


# -- a tensorwire transport --------------------------------------------------------------------------
def _tensorwire_client(conn: Connection, transport: Transport, url: str, server_pid: int, plan: Plan) -> None:
    """Child: measure one transport (the module doc); sends ``("ready", result)`` when done."""
    with starting(conn):
        server = None
        if transport.in_process:
            server = tensorwire.ServerThread([transport.listen])
            url, server_pid = server.url, os.getpid()
        try:
            with tensorwire.connect(url) as client:
                result = _measure(client, plan, server_pid)
        finally:
            if server is not None:
                server.close()
        conn.send(("ready", result))


def _measure(client: tensorwire.Client, plan: Plan, server_pid: int) -> Result:
    put, get = [], []
    for size in plan.sizes:
        data, out = torch.rand(size // 4), torch.zeros(size // 4)
        put.append(size / _median_s(partial(client.put, "sweep/x", data), plan.iters(size)) / 1e9)
        get.append(size / _median_s(partial(client.get, "sweep/x", out=out), plan.iters(size)) / 1e9)
        if not torch.equal(out, data):
            raise RuntimeError(f"a {size}-byte tensor came back different")
    client.delete("sweep/x")
    client.put("sweep/small", torch.rand(LATENCY_BYTES // 4))
    small = torch.zeros(LATENCY_BYTES // 4)
    samples = []
    for i in range(plan.latency_iters + 10):
        start = time.perf_counter_ns()
        client.get("sweep/small", out=small)
        if i >= 10:
            samples.append(time.perf_counter_ns() - start)
    data, out = torch.rand(plan.cpu_size // 4), torch.zeros(plan.cpu_size // 4)

    def move() -> None:
        for _ in range(plan.cpu_iters):
            client.put("sweep/cpu", data)
            client.get("sweep/cpu", out=out)

    pids = [os.getpid()] if server_pid == os.getpid() else [os.getpid(), server_pid]
    cpu = _cpu_per_gb(pids, 2 * plan.cpu_iters * plan.cpu_size, move)
    return {
        "put_gbps": put,
        "get_gbps": get,
        "latency_us": _percentiles(samples),
        "cpu_s_per_gb": {"client": cpu[0], "server": cpu[1] if len(cpu) > 1 else None},
        "peak_rss_bytes": {
            "client": peak_rss(os.getpid()),
            "server": peak_rss(server_pid) if len(pids) > 1 else None,
        },
    }


# -- the plain socket peer ---------------------------------------------------------------------------
_LEN = struct.Struct("<Q")
_ECHO = 1 << 63  # the length's top bit: send the bytes back instead of a one-byte ack


def _sized_sink(conn: Connection, max_size: int) -> None:
    """Child: a default-option socket that takes length-prefixed transfers into one preallocated
    buffer and acks each with a byte (or echoes it back)."""
    with starting(conn):
        listener = socket.create_server(("127.0.0.1", 0))
        target = torch.empty(max(max_size, LATENCY_BYTES), dtype=torch.uint8)
        target.zero_()  # fault the pages in now
        view, head = byte_view(target), memoryview(bytearray(_LEN.size))
        conn.send(("ready", listener.getsockname()[1]))
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock, listener:
        while recv_exactly(sock, head):
            (word,) = _LEN.unpack(head)
            size = word & ~_ECHO
            if not recv_exactly(sock, view[:size]):
                break
            sock.sendall(view[:size] if word & _ECHO else b"\x01")


def _send(sock: socket.socket, head: bytes, view: memoryview) -> None:
    """Header and data in one system call where they fit (two writes would meet Nagle's delay)."""
    sent = sock.sendmsg([head, view]) - len(head)
    if sent < 0:
        sock.sendall(head[sent:])
        sent = 0
    if sent < view.nbytes:
        sock.sendall(view[sent:])


def _socket_client(conn: Connection, port: int, sink_pid: int, plan: Plan) -> None:
    """Child: the socket peer's bandwidth at each size, its 4 KiB echo latency, CPU and memory."""
    with starting(conn):
        conn.send(("ready", _socket_measure(port, sink_pid, plan)))


def _socket_measure(port: int, sink_pid: int, plan: Plan) -> Result:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        ack = memoryview(bytearray(LATENCY_BYTES))

        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def send(view: memoryview, echo: bool = False) -> None:
            _send(sock, _LEN.pack(view.nbytes | (_ECHO if echo else 0)), view)
            if not recv_exactly(sock, ack[: view.nbytes if echo else 1]):
                raise ConnectionError("the socket sink closed the connection")

        send_gbps = []
        for size in plan.sizes:
            view = byte_view(torch.rand(size // 4))
            send_gbps.append(size / _median_s(partial(send, view), plan.iters(size)) / 1e9)
        small = byte_view(torch.rand(LATENCY_BYTES // 4))
        samples = []
        for i in range(plan.latency_iters + 10):
            start = time.perf_counter_ns()
            send(small, echo=True)
            if i >= 10:
                samples.append(time.perf_counter_ns() - start)
        bulk = byte_view(torch.rand(plan.cpu_size // 4))

        def move() -> None:
            for _ in range(2 * plan.cpu_iters):
                send(bulk)

        cpu = _cpu_per_gb([os.getpid(), sink_pid], 2 * plan.cpu_iters * plan.cpu_size, move)
    return {
        "send_gbps": send_gbps,
        "latency_us": _percentiles(samples),
        "cpu_s_per_gb": {"client": cpu[0], "server": cpu[1]},
        "peak_rss_bytes": {"client": peak_rss(os.getpid()), "server": peak_rss(sink_pid)},
    }


def memcpy_gbps(plan: Plan) -> list[float]:
    """``copy_`` into a preallocated tensor at each size: the ceiling of any same-host path."""
    rates = []
    for size in plan.sizes:
        src, dst = torch.rand(size // 4), torch.zeros(size // 4)
        rates.append(size / _median_s(partial(dst.copy_, src), plan.iters(size)) / 1e9)
    return rates


# -- the run ---------------------------------------------------------------------------------------
CLIENT_TIMEOUT = 1800.0  # a whole sweep of one transport on a slow, loaded machine


def _transport(t: Transport, plan: Plan, capacity: int, cpus: tuple[Cpus, Cpus]) -> Result:
    """One transport's results; its server and client children are gone when this returns."""
    with spawned() as children:
        url, server_pid = "", 0
        if not t.in_process:
            children.append(Child(_serve_tensorwire, capacity, [t.listen], cpus=cpus[1]))
            (url,) = children[0].ready()  # type: ignore[misc]
            server_pid = children[0].pid
        children.append(Child(_tensorwire_client, t, url, server_pid, plan, cpus=cpus[0]))
        result = children[-1].ready(CLIENT_TIMEOUT)
    assert isinstance(result, dict)
    return result


def _socket(plan: Plan, cpus: tuple[Cpus, Cpus]) -> Result:
    with spawned() as children:
        children.append(Child(_sized_sink, max(plan.sizes[-1], plan.cpu_size), cpus=cpus[1]))
        port = children[0].ready()
        children.append(Child(_socket_client, port, children[0].pid, plan, cpus=cpus[0]))
        result = children[-1].ready(CLIENT_TIMEOUT)
    assert isinstance(result, dict)
    return result


def run(plan: Plan, transports: Sequence[Transport] = TRANSPORTS, pin: bool = True) -> Result:
    """Every transport, then the peers; every child process is gone when this returns or raises."""
    cpus = placement(pin)
    capacity = 4 * max(plan.sizes[-1], plan.cpu_size) + 64 * MiB
    gbps: dict[str, list[float]] = {}
    latency, cpu, rss = {}, {}, {}
    skipped: dict[str, str] = {}
    for t in transports:
        missing = rdma_engine.unavailable() if t.listen.startswith("rdma://") else None
        if missing is not None:
            skipped[t.name] = missing
            continue
        r = _transport(t, plan, capacity, cpus)
        gbps[f"{t.name} put"], gbps[f"{t.name} get"] = r["put_gbps"], r["get_gbps"]
        latency[t.name], cpu[t.name], rss[t.name] = r["latency_us"], r["cpu_s_per_gb"], r["peak_rss_bytes"]
    r = _socket(plan, cpus)
    gbps["socket send"] = r["send_gbps"]
    latency["socket echo"], cpu["socket"], rss["socket"] = (
        r["latency_us"],
        r["cpu_s_per_gb"],
        r["peak_rss_bytes"],
    )
    gbps["memcpy"] = memcpy_gbps(plan)
    return {
        "sizes": list(plan.sizes),
        "gbps": gbps,
        "latency_bytes": LATENCY_BYTES,
        "latency_us": latency,
        "cpu_bytes": plan.cpu_size,
        "cpu_s_per_gb": cpu,
        "peak_rss_bytes": rss,
        "pinned": cpus[0] is not None,
        "transports": [t.name for t in transports if t.name not in skipped],
        "skipped": skipped,
    }


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tensorwire bench sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--max-size", type=parse_size, default=parse_size("256MiB"), help="largest tensor")
    parser.add_argument("--budget", type=parse_size, default=parse_size("512MiB"),
                        help="bytes moved per size and direction (sets the runs per size)")  # fmt: skip
    parser.add_argument("--latency-iters", type=int, default=2000, help="timed 4 KiB gets per transport")
    parser.add_argument(
        "--cpu-size", type=parse_size, default=parse_size("64MiB"), help="tensor size for CPU/GB"
    )
    parser.add_argument("--cpu-iters", type=int, default=4, help="puts and gets of --cpu-size for CPU/GB")
    parser.add_argument("--transports", type=_names, default=[t.name for t in TRANSPORTS],
                        help="comma-separated, of: " + ", ".join(t.name for t in TRANSPORTS))  # fmt: skip
    add_run_options(parser, pin_help="leave placement to the scheduler")
    return parser.parse_args(argv)


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = {t.name for t in TRANSPORTS}
    if not names or not set(names) <= known:
        raise argparse.ArgumentTypeError(f"transports must be some of {', '.join(sorted(known))}")
    return names


def format_table(r: Result) -> str:
    names = list(r["gbps"])
    head = "size       " + "".join(f"{n:>13}" for n in names)
    lines = [f"{_size(s):<11}" + "".join(f"{r['gbps'][n][i]:>13.3f}" for n in names)
             for i, s in enumerate(r["sizes"])]  # fmt: skip
    lines.append("")
    for name, p in r["latency_us"].items():
        lines.append(
            f"{name:<12} 4 KiB get p50 {p['p50']:8.1f} us  p90 {p['p90']:8.1f} us  p99 {p['p99']:8.1f} us"
        )
    for name, c in r["cpu_s_per_gb"].items():
        server = "in-process" if c["server"] is None else f"{c['server']:.2f}"
        lines.append(f"{name:<12} CPU s/GB client {c['client']:.2f}  server {server}")
    for name, m in r["peak_rss_bytes"].items():
        server = "in-process" if m["server"] is None else f"{m['server'] / MiB:.0f} MiB"
        lines.append(f"{name:<12} peak RSS client {m['client'] / MiB:.0f} MiB  server {server}")
    return "GB/s by tensor size (1e9 bytes/s)\n" + "\n".join([head, *lines])


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main(argv: list[str] | None = None) -> Result:
    args = _parse_args(argv)
    sizes = sizes_up_to(args.max_size)
    if not sizes:
        raise SystemExit(f"--max-size must be at least {MIN_SIZE} bytes")
    plan = Plan(
        sizes, args.budget, max(1, args.latency_iters), max(MIN_SIZE, args.cpu_size), max(1, args.cpu_iters)
    )
    result = run(plan, [t for t in TRANSPORTS if t.name in args.transports], pin=args.pin)
    return show(result, args.json, format_table)


if __name__ == "__main__":
    main(sys.argv[1:])
