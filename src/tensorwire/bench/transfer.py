"""Transfer benchmark: tensorwire next to the baselines it should be judged against.

Every number comes with its baseline from the same run, because the machine is shared and noisy:
the ratios (``put_ratio``, ``get_ratio``, ``small_ratio``) are what to compare between runs, not
the absolute numbers.

* bulk: ``put`` / ``get(out=...)`` of one large float32 tensor against a plain loopback TCP
  socket (``sendall`` of a memoryview, ``recv_into`` a preallocated tensor, one-byte ack).
* small: p50 latency of a 1 KiB ``get`` (asyncio and blocking clients) against a 1 KiB asyncio
  echo round trip on the same kind of event loop; the asyncio get and the echo take turns, one
  round trip each, so that the ratio compares the same moments.
* small, in CPU: client + server CPU per 1 KiB ``get`` of the blocking client
  (``small_get_cpu_us``, and its two parts), from both processes' CPU times over 10,000 gets:
  what a request costs, stable on a noisy host where latency follows the host's wake-up cost;
  next to its floor, a blocking socket's 1 KiB round trip through the asyncio echo server
  (``small_echo_cpu_us``, ``small_cpu_vs_echo``; bench/small_cpu.py). The client does not spin
  for it (``busy_wait=0``): a spin burns CPU for as long as the answer takes, which is latency
  again, not work.
* tls: ``put`` / ``get(out=...)`` over ``tls://``, against tcp:// and against their own bound: one
  core's AES-256-GCM in series with the tcp:// path of the same run (bench/tls_bound.py); and
  against the simplest stream through Python's ``ssl`` alone (bench/tls_loop.py).
* many: tensors per second of one ``put_many`` / ``get_many`` of thousands of 1 KiB tensors.
* shm: ``put`` / ``get(out=...)`` over ``shm://`` against a memcpy of the same size (bench/shm.py).
* rdma: ``put`` / ``get(out=...)`` over ``rdma://`` against the bare transfer engine moving the same
  bytes (bench/rdma.py); None, with ``rdma_note`` saying why, where the engine cannot run.

Servers always run in child processes (``spawn``), so client and server never share an
interpreter; children report readiness through a pipe and stop when that pipe tells them to (or
closes), and are killed if they do not exit in time.

Placement: with two or more CPUs the client side is pinned to one CPU and every server to
another (``--no-pin`` leaves placement to the scheduler). On this class of VM a wake-up across CPUs
costs ~50 us while one on the same CPU costs almost nothing, so unpinned runs flip between the two
placements and a latency ratio moves by 2x from run to run; pinned, each side has a core of its
own, as it would on separate machines.

Socket options: the baseline uses the kernel defaults on both ends (no TCP_NODELAY, default and
auto-tuned buffer sizes): it stands for what any program gets from a plain socket. tensorwire
tunes its own sockets (TCP_NODELAY, 4 MiB SO_SNDBUF/SO_RCVBUF; see ``transport/tcp.py``).

Run: ``python -m tensorwire.bench.transfer [--size 256MiB] [--iters 5] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import re
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

import tensorwire
from tensorwire import _aio, _extensions
from tensorwire._gc import freeze_loaded
from tensorwire.bench import fastpaths, pinglag, tls_bound, tls_loop
from tensorwire.bench import rdma as rdma_bench
from tensorwire.bench import shm as shm_bench
from tensorwire.bench import small_cpu as small_cpu_bench
from tensorwire.bench.children import (
    Child,
    add_run_options,
    pinned,
    placement,
    recv_exactly,
    spawned,
    starting,
    until_stopped,
)
from tensorwire.bench.report import show
from tensorwire.bench.small_cpu import SMALL_BYTES, warmup_count
from tensorwire.bench.transfer_table import Result, format_table
from tensorwire.client import ClientOptions
from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.server.core import Server
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.transport import rdma_engine
from tensorwire.types import KiB, MiB
from tensorwire.wire.tensors import byte_view

T = TypeVar("T")

MANY_REPEATS = 3
_UNITS = {"": 1, "B": 1, "KIB": KiB, "MIB": MiB, "GIB": 1 << 30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMG]IB|B)?\s*", re.IGNORECASE)


# -- options ---------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"256MiB"`` -> 268435456; accepts bytes or KiB/MiB/GiB, rounded down to whole float32s."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 256MiB, 64KiB, 1GiB)")
    nbytes = int(float(match[1]) * _UNITS[(match[2] or "").upper()]) // 4 * 4
    if nbytes < 4:
        raise argparse.ArgumentTypeError(f"size {text!r} is smaller than one float32")
    return nbytes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tensorwire.bench.transfer", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("256MiB"), help="bulk tensor size")
    parser.add_argument("--iters", type=_positive, default=5, help="timed bulk iterations (after warm-up)")
    parser.add_argument("--small-iters", type=_positive, default=2000, help="timed 1 KiB round trips")
    parser.add_argument("--many", type=_positive, default=10_000, help="1 KiB tensors per put_many/get_many")
    parser.add_argument(
        "--ping-put-size", type=parse_size, default=parse_size("1GiB"),
        help="the put that 1 KiB pings from another client run beside (ping_during_put_p99_ms)",
    )  # fmt: skip
    add_run_options(parser)
    return parser.parse_args(argv)


# -- child processes -------------------------------------------------------------------------------
def _serve_tensorwire(
    conn: Connection, capacity: int, urls: list[str], certs: dict[str, Path] | None = None
) -> None:
    """Child: a tensorwire server on ``urls`` (free loopback ports), on the preferred event loop;
    ``certs`` serve the tls:// ones. Answers with the bound addresses. Frozen as ``serve`` is."""
    freeze_loaded()
    _aio.run(_serve_tensorwire_async(conn, capacity, urls, certs))


async def _serve_tensorwire_async(
    conn: Connection, capacity: int, urls: list[str], certs: dict[str, Path] | None
) -> None:
    tls = TlsFiles(certs["server"], certs["server_key"]) if certs else None
    server = Server(ServerOptions(tls=tls), store=TensorStore(capacity=capacity))
    with starting(conn):
        addresses = await server.start(*urls)
        conn.send(("ready", [str(a) for a in addresses]))
    try:
        await until_stopped(conn)
    finally:
        await server.close()


def socket_sink(conn: Connection, nbytes: int) -> None:
    """Child: receive ``nbytes``-sized transfers on a default-option socket, ack each with a byte."""
    with starting(conn):
        listener = socket.create_server(("127.0.0.1", 0))
        target = torch.empty(nbytes, dtype=torch.uint8)
        target.zero_()  # fault the pages in now: the timed receives should not pay for them
        view = byte_view(target)
        conn.send(("ready", listener.getsockname()[1]))
    with listener:
        # Accept, unless the parent gives up first (then the pipe becomes readable instead).
        if listener not in multiprocessing.connection.wait([listener, conn]):
            return
        sock, _ = listener.accept()
    with sock:
        while recv_exactly(sock, view):
            sock.sendall(b"\x01")


def _echo_server(conn: Connection) -> None:
    """Child: an asyncio-streams echo server, on the same kind of loop as the tensorwire server."""
    _aio.run(_echo_server_async(conn))


async def _echo_server_async(conn: Connection) -> None:
    with starting(conn):
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        conn.send(("ready", server.sockets[0].getsockname()[1]))
    async with server:
        await until_stopped(conn)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(64 * KiB):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


# -- measurements ----------------------------------------------------------------------------------
def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_seconds(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(_timed(fn) for _ in range(iters))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class _Bulk(Protocol):  # a tensorwire.Client, or the ssl loop's stream (bench/tls_loop.py)
    def put(self, name: str, tensor: torch.Tensor) -> object: ...
    def get(self, name: str, out: torch.Tensor) -> object: ...


def bulk_in_turns(
    clients: dict[str, _Bulk], data: torch.Tensor, iters: int
) -> dict[str, tuple[float, float]]:
    """(put_gbps, get_gbps) of one large tensor for each client (by the name it stores under),
    the clients taking turns, one put each, then one get each, ``iters`` times: a ratio between
    two of them (tls:// over tcp://) compares the same moments of a noisy machine (measured one
    after the other, tls_vs_bound moved between 0.26 and 0.79 over seven runs, mostly tcp://'s
    half). Gets land in preallocated tensors."""
    outs = {name: torch.empty_like(data) for name in clients}
    for out in outs.values():
        out.zero_()  # touched once, so the timed gets measure transfer, not page faults
    puts: dict[str, list[float]] = {name: [] for name in clients}
    gets: dict[str, list[float]] = {name: [] for name in clients}
    # Two warm-ups for put: an overwritten tensor stays readable until its replacement is
    # committed, so the server alternates between two buffers, and the first two land in fresh pages.
    for _ in range(2):
        for name, client in clients.items():
            client.put(name, data)
    for name, client in clients.items():
        client.get(name, out=outs[name])
    for _ in range(iters):
        for name, client in clients.items():
            start = time.perf_counter()
            client.put(name, data)
            puts[name].append(time.perf_counter() - start)
        for name, client in clients.items():
            start = time.perf_counter()
            client.get(name, out=outs[name])
            gets[name].append(time.perf_counter() - start)
    nbytes = data.numel() * data.element_size()
    for name, out in outs.items():
        if not torch.equal(out, data):
            raise RuntimeError(f"{name} came back different from what was put")
    return {
        name: (_gbps(nbytes, statistics.median(puts[name])), _gbps(nbytes, statistics.median(gets[name])))
        for name in clients
    }


def socket_baseline(port: int, data: torch.Tensor, iters: int) -> float:
    """GB/s of ``sendall`` of the tensor's bytes until the receiver has acked the whole of them."""
    view = byte_view(data)
    ack = memoryview(bytearray(1))

    def transfer() -> None:
        sock.sendall(view)
        if not recv_exactly(sock, ack):
            raise ConnectionError("the socket sink closed the connection")

    with socket.create_connection(("127.0.0.1", port)) as sock:
        return _gbps(view.nbytes, _median_seconds(transfer, iters))


def _p50_us(samples_ns: list[int]) -> float:
    return statistics.median(samples_ns) / 1e3


def _sync_small_us(client: tensorwire.Client, iters: int) -> float:
    out = torch.zeros(SMALL_BYTES // 4)
    samples = []
    for i in range(warmup_count(iters) + iters):
        start = time.perf_counter_ns()
        client.get("bench/small", out=out)
        if i >= warmup_count(iters):
            samples.append(time.perf_counter_ns() - start)
    return _p50_us(samples)


async def _small_and_echo_us(
    url: str, echo_port: int, iters: int, busy_wait: float = ClientOptions().busy_wait
) -> tuple[float, float]:
    """p50 of a 1 KiB asyncio ``get`` and of a 1 KiB asyncio echo, one of each in turn: both see
    the same moments of a noisy machine, so their ratio holds still between runs (measured one
    after the other, it moved between 1.6 and 2.6 within ten minutes). ``busy_wait``: the client's."""
    client = await tensorwire.aconnect(url, busy_wait=busy_wait)
    reader, writer = await asyncio.open_connection("127.0.0.1", echo_port)
    try:
        out = torch.zeros(SMALL_BYTES // 4)
        message = bytes(SMALL_BYTES)
        gets, echoes = [], []
        for i in range(warmup_count(iters) + iters):
            start = time.perf_counter_ns()
            await client.get("bench/small", out=out)
            middle = time.perf_counter_ns()
            writer.write(message)
            await reader.readexactly(SMALL_BYTES)
            if i >= warmup_count(iters):
                gets.append(middle - start)
                echoes.append(time.perf_counter_ns() - middle)
        return _p50_us(gets), _p50_us(echoes)
    finally:
        await client.close()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def _on_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a fresh loop of the kind tensorwire prefers (uvloop when installed)."""
    with asyncio.Runner(loop_factory=_aio.new_event_loop) as runner:
        return runner.run(coro)


def _loop_name() -> str:
    loop = _aio.new_event_loop()
    try:
        return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
    finally:
        loop.close()


def _many(client: tensorwire.Client, count: int) -> tuple[float, float]:
    """(put_many, get_many) in tensors per second for ``count`` distinct 1 KiB tensors."""
    names = [f"many/{i:05d}" for i in range(1, count + 1)]
    tensors = {name: torch.rand(SMALL_BYTES // 4) for name in names}
    outs = {name: torch.zeros(SMALL_BYTES // 4) for name in names}
    put = _median_seconds(lambda: client.put_many(tensors), MANY_REPEATS)
    get = _median_seconds(lambda: client.get_many(names, out=outs), MANY_REPEATS)
    return count / put, count / get


def _ratio(value: float, baseline: float) -> float | None:
    return value / baseline if baseline > 0 else None


# -- the run ---------------------------------------------------------------------------------------
class _Servers(NamedTuple):
    """Where the children listen: tensorwire over tcp:// and tls://, the plain socket's sink, the
    echo server, tensorwire over shm://, the ssl loop's peer and, where the engine runs, over
    rdma:// with the bare engine's peer (``rdma_missing`` says why not)."""

    url: str
    tls_url: str
    server_pid: int  # the process serving ``url`` and ``tls_url``
    sink_port: int
    echo_port: int
    echo_pid: int  # the process serving ``echo_port``
    shm_url: str
    tls_loop_port: int
    rdma: tuple[str, tuple[Any, ...]] | None
    rdma_missing: str | None


def _start_servers(
    children: list[Child], size: int, *, many: int, ping_put_size: int, certs: dict[str, Path], cpus: Any
) -> _Servers:
    """Every server child started, on ``cpus``, before waiting for any (each spends over a second
    importing torch); each is appended to ``children`` as it starts (``spawned()``: it ends them,
    also the ones started before an error)."""
    # Room for the stored tensor, the one being put over it and the store's reuse pool (a quarter
    # of capacity must hold one bulk buffer, or every timed put would fault in fresh pages).
    capacity = 6 * size + 4 * many * SMALL_BYTES + 64 * MiB  # tcp and tls runs each keep a copy
    capacity += 2 * ping_put_size  # the ping run's put and the one that replaces it
    capacity += 6 * min(size, fastpaths.COMPRESSIBLE_MAX)  # the fast paths' sparse and noise tensors
    urls = ["tcp://127.0.0.1:0", "tls://127.0.0.1:0"]
    served = Child(_serve_tensorwire, capacity, urls, certs, cpus=cpus)
    children.append(served)
    children.append(Child(socket_sink, size, cpus=cpus))
    echo = Child(_echo_server, cpus=cpus)
    children.append(echo)
    shm_capacity = 4 * size + 64 * MiB  # a server of its own: its tensors live in /dev/shm
    children.append(Child(_serve_tensorwire, shm_capacity, ["shm://127.0.0.1:0"], cpus=cpus))
    children.append(Child(tls_loop.tls_peer, certs, size, cpus=cpus))
    rdma_missing = rdma_engine.unavailable()
    if rdma_missing is None:  # rdma://, and the bare engine it is judged against
        children.append(Child(_serve_tensorwire, 4 * size + 64 * MiB, ["rdma://127.0.0.1:0"], cpus=cpus))
        children.append(Child(rdma_bench.engine_peer, size, cpus=cpus))
    ready = [child.ready() for child in children]
    bound, sink_port, echo_port, shm_bound, loop_port = ready[:5]
    assert isinstance(bound, list) and isinstance(sink_port, int) and isinstance(echo_port, int)
    assert isinstance(shm_bound, list) and isinstance(loop_port, int)
    rdma = None
    if rdma_missing is None:
        rdma_bound, peer = ready[5:7]
        assert isinstance(rdma_bound, list) and isinstance(peer, tuple)
        rdma = (rdma_bound[0], peer)
    return _Servers(bound[0], bound[1], served.pid, sink_port, echo_port, echo.pid, shm_bound[0],
                    loop_port, rdma, rdma_missing)  # fmt: skip


def run(
    size: int, iters: int, small_iters: int, many: int, pin: bool = True, *, ping_put_size: int = 1 << 30
) -> Result:
    """Measure everything; every child process is gone when this returns or raises."""
    client_cpus, server_cpus = placement(pin)
    data = torch.rand(size // 4)
    with contextlib.ExitStack() as stack:
        certs = write_dev_certs(Path(stack.enter_context(tempfile.TemporaryDirectory())))
        children = stack.enter_context(spawned())  # first: also ends the ones started before an error
        servers = _start_servers(
            children, size, many=many, ping_put_size=ping_put_size, certs=certs, cpus=server_cpus
        )
        stack.enter_context(pinned(client_cpus))
        measured = _measure(servers, data, iters=iters, small_iters=small_iters, many=many,
                            ca=str(certs["ca"]), ping_put_size=ping_put_size)  # fmt: skip
    settings = {"size_bytes": size, "iters": iters, "small_iters": small_iters, "many": many}
    hot_path = "compiled" if _extensions.compiled() else "pure"  # the servers' is the same
    loop, on_cpus = _loop_name(), client_cpus is not None
    return {**measured, **settings, "loop": loop, "pinned": on_cpus, "hot_path": hot_path}


def _measure(
    s: _Servers, data: torch.Tensor, *, iters: int, small_iters: int, many: int, ca: str, ping_put_size: int
) -> Result:
    """Every figure, each next to its baseline, in this order (the machine is the same for all)."""
    socket_gbps = socket_baseline(s.sink_port, data, iters)
    tls_files = TlsFiles(ca=Path(ca))
    with (
        tensorwire.connect(s.url) as client,
        tensorwire.connect(s.tls_url, tls=tls_files) as tls_client,
        tls_loop.SslLoop(s.tls_loop_port, Path(ca)) as loop,  # inside: closed if a connect fails
    ):
        bulk = bulk_in_turns({"bench/x": client, "bench/tls": tls_client, "ssl-loop": loop}, data, iters)
        (put_gbps, get_gbps), (tls_put_gbps, tls_get_gbps) = bulk["bench/x"], bulk["bench/tls"]
        ssl_loop = tls_loop.report(*bulk["ssl-loop"], tls_put_gbps, tls_get_gbps)
        client.put("bench/small", torch.rand(SMALL_BYTES // 4))
        sync_small_us = _sync_small_us(client, small_iters)
    with tensorwire.connect(s.url, busy_wait=0.0) as client:
        small_cpu = small_cpu_bench.measure(client, s.server_pid, s.echo_port, s.echo_pid)
    with tensorwire.connect(s.url) as client:
        many_put, many_get = _many(client, many)
    tls = tls_bound.bound(tls_bound.aead(), put_gbps, get_gbps, tls_put_gbps, tls_get_gbps)
    segments = _segment_transports(s, data, iters)
    small_us, echo_us = _on_loop(_small_and_echo_us(s.url, s.echo_port, small_iters))
    # What the client's spin (busy_wait) buys: the same without it, against its own echoes.
    unspun_us, unspun_echo_us = _on_loop(_small_and_echo_us(s.url, s.echo_port, small_iters, 0.0))
    fast = fastpaths.measure(s.url, data, iters, small_iters)  # striping, compression, cache
    fast.update(fastpaths.iperf(put_gbps, get_gbps))  # the ceiling of one TCP stream
    pings = pinglag.measure(s.url, ping_put_size)  # how long a big put makes another client wait
    return {
        **fast,
        **pings,
        "put_gbps": put_gbps,
        "get_gbps": get_gbps,
        "socket_gbps": socket_gbps,
        "put_ratio": _ratio(put_gbps, socket_gbps),
        "get_ratio": _ratio(get_gbps, socket_gbps),
        **small_cpu,
        "small_get_us": small_us,
        "sync_small_get_us": sync_small_us,
        "echo_us": echo_us,
        "small_ratio": _ratio(small_us, echo_us),
        "small_unspun_get_us": unspun_us,
        "small_unspun_echo_us": unspun_echo_us,
        "small_unspun_ratio": _ratio(unspun_us, unspun_echo_us),
        "many_small_per_s": many_put,
        "many_get_per_s": many_get,
        "tls_put_gbps": tls_put_gbps,
        "tls_get_gbps": tls_get_gbps,
        "tls_put_ratio": _ratio(tls_put_gbps, put_gbps),  # what TLS costs: tls:// over tcp://
        "tls_get_ratio": _ratio(tls_get_gbps, get_gbps),
        **tls,  # tls:// against its own ceiling: one core's AEAD in series with the plain path
        **ssl_loop,  # and against the ssl module's: the simplest stream through it
        **segments,
    }


def _segment_transports(s: _Servers, data: torch.Tensor, iters: int) -> Result:
    """shm:// against a memcpy and rdma:// against the bare engine (skipped, saying why, where the
    engine cannot run)."""
    with tensorwire.connect(s.shm_url) as client:
        shm = shm_bench.measure(client, data, iters)
    rdma = rdma_bench.skipped(s.rdma_missing or "")
    if s.rdma is not None:
        with tensorwire.connect(s.rdma[0]) as client:
            rdma = rdma_bench.measure(client, data, iters, rdma_bench.EnginePeer(*s.rdma[1]))
    return {**shm, **rdma}


def main(argv: list[str] | None = None) -> Result:
    args = _parse_args(argv)
    sizes = (args.size, args.iters, args.small_iters, args.many)
    result = run(*sizes, args.pin, ping_put_size=args.ping_put_size)
    return show(result, args.json, format_table)


if __name__ == "__main__":
    main(sys.argv[1:])
