"""Peers benchmark: tensorwire next to what a user would pick instead, on the same bytes in one run.

* ray (``peers_ray.py``): Ray's object store on one node against tensorwire over shm:// and tcp://.
* mooncake: the bare Mooncake Transfer Engine in its TCP mode (write and read of the bulk tensor
  into a buffer a child process registered, a 1 KiB read) against tcp:// put/get and a plain
  socket (the ``transfer`` benchmark's sink).
* gloo: ``torch.distributed`` send/recv (gloo) between this process and a child, the bulk tensor
  acked by one byte and a 1 KiB ping-pong, against tcp:// put/get.

Ratios are ``tw_<transport>_vs_<peer>_<what>``: above 1 means tensorwire is better (for latencies
the peer's time over tensorwire's). A peer that cannot run here (its extra not installed, no
libibverbs1) gives None for its figures and ``<peer>_note`` saying why, never a measurement of
something else; one that fails midway does the same with the error. Servers and peers run in
child processes (``bench/children.py``); every one is ended when the benchmark returns.

Run: ``tensorwire bench peers [--peers ray,mooncake,gloo] [--size 256MiB] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

import tensorwire
from tensorwire.bench import peers_ray, transfer
from tensorwire.bench import rdma as rdma_bench
from tensorwire.bench.children import Child, add_run_options, spawned, starting
from tensorwire.bench.fastpaths import p50_us, ratio
from tensorwire.bench.report import show, table
from tensorwire.bench.transfer import parse_size
from tensorwire.ps.launch import free_port
from tensorwire.transport import rdma_engine
from tensorwire.types import KiB, MiB
from tensorwire.wire.tensors import byte_view

Result = dict[str, float | int | str | None]
SMALL_BYTES = KiB
GLOO_TIMEOUT = timedelta(seconds=120)
TCP_KEYS = ("tw_tcp_bulk_put_gbps", "tw_tcp_bulk_get_gbps", "tw_tcp_small_get_us", "socket_gbps")
MOONCAKE_KEYS = (
    "mooncake_write_gbps", "mooncake_read_gbps", "mooncake_read_us",
    "mooncake_vs_socket_write", "mooncake_vs_socket_read",
    "tw_tcp_vs_mooncake_write", "tw_tcp_vs_mooncake_read", "tw_tcp_vs_mooncake_read_us",
)  # fmt: skip
GLOO_KEYS = ("gloo_send_gbps", "gloo_us", "tw_tcp_vs_gloo", "tw_tcp_get_vs_gloo", "tw_tcp_vs_gloo_us")
PEERS = ("ray", "mooncake", "gloo")


def _peers(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = set(names) - set(PEERS)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown peers {sorted(unknown)}; known: {', '.join(PEERS)}")
    return names


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(parse_size(n.strip()) for n in text.split(",") if n.strip())
    if not sizes or any(n < 4 for n in sizes):
        raise argparse.ArgumentTypeError(f"sizes of at least 4 bytes, comma-separated; got {text!r}")
    return sizes


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tensorwire bench peers", description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=_peers, default=PEERS, help="comma-separated: ray,mooncake,gloo")
    parser.add_argument("--size", type=parse_size, default=parse_size("256MiB"), help="mooncake/gloo bulk")
    parser.add_argument("--ray-size", type=parse_size, default=parse_size("16MiB"), help="Ray's put/get")
    parser.add_argument("--rdt-sizes", type=_sizes, default=(64 * MiB, 256 * MiB),
                        help="Ray RDT actor-to-actor tensors, comma-separated [64MiB,256MiB]")  # fmt: skip
    parser.add_argument("--iters", type=int, default=5, help="timed bulk rounds (after warm-up)")
    parser.add_argument("--small-iters", type=int, default=1000, help="timed 1 KiB round trips")
    parser.add_argument("--many", type=int, default=10_000, help="small objects put (Ray: single puts)")
    add_run_options(parser, "unused: Ray starts processes of its own, so nothing is pinned")
    return parser.parse_args(argv)


# -- helpers ---------------------------------------------------------------------------------------
def skipped(keys: Sequence[str], peer: str, reason: str) -> Result:
    return {**dict.fromkeys(keys), f"{peer}_note": reason}


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """``name=value`` while inside (children spawned inside inherit it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# -- tcp:// and the plain socket: what the mooncake and gloo figures are judged against ------------
def tcp_figures(url: str, sink_port: int, data: torch.Tensor, args: argparse.Namespace) -> Result:
    with tensorwire.connect(url) as client:
        put, get = transfer.bulk_in_turns({"peers/bulk": client}, data, args.iters)["peers/bulk"]
        client.put("bench/small", torch.rand(SMALL_BYTES // 4))
        small_us = transfer._sync_small_us(client, args.small_iters)
    socket_gbps = transfer.socket_baseline(sink_port, data, args.iters)
    return dict(zip(TCP_KEYS, (put, get, small_us, socket_gbps), strict=True))


# -- mooncake --------------------------------------------------------------------------------------
def mooncake(
    peer: rdma_bench.EnginePeer, data: torch.Tensor, tcp: Result, args: argparse.Namespace
) -> Result:
    """The bare engine (this process's client engine) writing and reading the peer's buffer."""
    with rdma_bench.client_engine_for(peer) as engine:
        return _mooncake(engine, peer, data, tcp, args)


def _mooncake(
    engine: rdma_engine.Engine,
    peer: rdma_bench.EnginePeer,
    data: torch.Tensor,
    tcp: Result,
    args: argparse.Namespace,
) -> Result:
    src, out = byte_view(data), torch.zeros_like(data)
    small = torch.zeros(SMALL_BYTES, dtype=torch.uint8)

    async def move(kind: str, buf: memoryview) -> None:
        with engine.cache.using(buf, landing=kind == "read") as local:
            call = engine.write if kind == "write" else engine.read
            await call(peer.session, local, peer.address, buf.nbytes, timeout=120.0)

    async def small_reads() -> float:
        samples = []
        for i in range(args.small_iters + 10):
            start = time.perf_counter_ns()
            await move("read", byte_view(small))
            if i >= 10:
                samples.append(time.perf_counter_ns() - start)
        return statistics.median(samples) / 1e3

    write_s = transfer._median_seconds(lambda: asyncio.run(move("write", src)), args.iters)
    read_s = transfer._median_seconds(lambda: asyncio.run(move("read", byte_view(out))), args.iters)
    if not torch.equal(out, data):
        raise RuntimeError("the engine read back different bytes from what it wrote")
    read_us = asyncio.run(small_reads())
    nbytes = src.nbytes
    write, read = nbytes / write_s / 1e9, nbytes / read_s / 1e9
    return {
        "mooncake_write_gbps": write,
        "mooncake_read_gbps": read,
        "mooncake_read_us": read_us,
        "mooncake_vs_socket_write": ratio(write, tcp["socket_gbps"]),  # type: ignore[arg-type]
        "mooncake_vs_socket_read": ratio(read, tcp["socket_gbps"]),  # type: ignore[arg-type]
        "tw_tcp_vs_mooncake_write": ratio(tcp["tw_tcp_bulk_put_gbps"], write),  # type: ignore[arg-type]
        "tw_tcp_vs_mooncake_read": ratio(tcp["tw_tcp_bulk_get_gbps"], read),  # type: ignore[arg-type]
        "tw_tcp_vs_mooncake_read_us": ratio(read_us, tcp["tw_tcp_small_get_us"]),  # type: ignore[arg-type]
        "mooncake_note": "engine protocol tcp (no RDMA NIC measured)",
    }


# -- gloo ------------------------------------------------------------------------------------------
def _gloo_init(port: int, rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=GLOO_TIMEOUT
    )


def gloo_peer(conn: Connection, port: int, nbytes: int, bulk_rounds: int) -> None:
    """Child: rank 1; receives ``bulk_rounds`` tensors of ``nbytes`` (one-byte ack each), then
    echoes 1 KiB tensors until one starts with a zero byte (the parent's stop)."""
    import torch.distributed as dist

    with starting(conn):
        buf = torch.zeros(nbytes, dtype=torch.uint8)  # pages faulted in before the timed rounds
        ack, small = torch.ones(1, dtype=torch.uint8), torch.zeros(SMALL_BYTES, dtype=torch.uint8)
        conn.send(("ready", None))
        _gloo_init(port, 1)
    try:
        for _ in range(bulk_rounds):
            dist.recv(buf, 0)
            dist.send(ack, 0)
        while True:
            dist.recv(small, 0)
            if small[0] == 0:
                break
            dist.send(small, 0)
    finally:
        dist.destroy_process_group()


def gloo(data: torch.Tensor, tcp: Result, args: argparse.Namespace) -> Result:
    """send/recv of the bulk tensor (until acked) and a 1 KiB ping-pong with a gloo child."""
    import torch.distributed as dist

    src = data.view(torch.uint8)
    small, ack = torch.ones(SMALL_BYTES, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    port = free_port()  # a race with another program is harmless here: init fails
    with spawned() as children:
        children.append(Child(gloo_peer, port, src.numel(), args.iters + 1))  # + 1: the warm-up
        children[0].ready()
        _gloo_init(port, 0)
        try:

            def bulk() -> None:
                dist.send(src, 1)
                dist.recv(ack, 1)

            def ping() -> None:
                dist.send(small, 1)
                dist.recv(small, 1)

            send_gbps = src.numel() / transfer._median_seconds(bulk, args.iters) / 1e9
            us = p50_us(ping, args.small_iters)
            dist.send(torch.zeros(SMALL_BYTES, dtype=torch.uint8), 1)  # stop
        finally:
            dist.destroy_process_group()
    return {
        "gloo_send_gbps": send_gbps,
        "gloo_us": us,
        "tw_tcp_vs_gloo": ratio(tcp["tw_tcp_bulk_put_gbps"], send_gbps),  # type: ignore[arg-type]
        "tw_tcp_get_vs_gloo": ratio(tcp["tw_tcp_bulk_get_gbps"], send_gbps),  # type: ignore[arg-type]
        "tw_tcp_vs_gloo_us": ratio(us, tcp["tw_tcp_small_get_us"]),  # type: ignore[arg-type]
        "gloo_note": "torch.distributed gloo, send + one-byte ack; 1 KiB send + recv back",
    }


def _gloo_missing() -> str | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no torch.distributed gloo backend"
    return None


def _guarded(keys: Sequence[str], peer: str, missing: str | None, measure: Callable[[], Result]) -> Result:
    """The peer's figures, or None for each with the reason (missing, or the error it failed with)."""
    if missing is not None:
        return skipped(keys, peer, missing)
    try:
        return measure()
    except Exception as exc:  # one peer's failure must not lose the others' figures
        return skipped(keys, peer, f"failed: {type(exc).__name__}: {exc}")


# -- the run ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> Result:
    """Every peer asked for; every child process is gone when this returns or raises."""
    data = torch.rand(args.size // 4)
    result: Result = {"size_bytes": args.size, "ray_size_bytes": args.ray_size, "iters": args.iters,
                      "many": args.many, "pinned": False}  # fmt: skip
    with _env(rdma_engine.PROTOCOL_ENV, "tcp"), spawned() as children:
        mooncake_missing = rdma_engine.unavailable() if "mooncake" in args.peers else "not asked for"
        bulk = {"mooncake", "gloo"} & set(args.peers)
        capacity = 4 * args.size + 4 * max(args.ray_size, args.many * SMALL_BYTES) + 64 * MiB
        urls = ["tcp://127.0.0.1:0", "shm://127.0.0.1:0"] if "ray" in args.peers else ["tcp://127.0.0.1:0"]
        # Start every child before waiting for any: each spends over a second importing torch.
        children.append(Child(transfer._serve_tensorwire, capacity, urls))
        if bulk:
            children.append(Child(transfer.socket_sink, args.size))
        if mooncake_missing is None:
            children.append(Child(rdma_bench.engine_peer, args.size))
        ready = [child.ready() for child in children]
        bound = ready[0]
        assert isinstance(bound, list)
        tcp: Result = dict.fromkeys(TCP_KEYS)
        if bulk:
            assert isinstance(ready[1], int)
            tcp = tcp_figures(bound[0], ready[1], data, args)
        result.update(tcp)
        if "ray" in args.peers:
            result.update(_guarded(peers_ray.KEYS, "ray", peers_ray.missing(),
                                   lambda: peers_ray.measure(bound, args)))  # fmt: skip
        if "mooncake" in args.peers:
            answer = ready[2] if mooncake_missing is None else None
            peer = rdma_bench.EnginePeer(*answer) if isinstance(answer, tuple) else None
            result.update(_guarded(MOONCAKE_KEYS, "mooncake", mooncake_missing,
                                   lambda: mooncake(peer, data, tcp, args)))  # type: ignore[arg-type]  # fmt: skip
        if "gloo" in args.peers:
            result.update(_guarded(GLOO_KEYS, "gloo", _gloo_missing(), lambda: gloo(data, tcp, args)))
    return result


def _fmt(value: float | int | str | None, spec: str) -> str:
    return "n/a" if not isinstance(value, float | int) else format(value, spec)


def format_table(r: Result) -> str:
    f = _fmt
    rows = [*peers_ray.rows(r, f)]
    if r["tw_tcp_bulk_put_gbps"] is not None:
        rows += [
            ("tcp:// put (bulk)", f"{f(r['tw_tcp_bulk_put_gbps'], '.3f')} GB/s", ""),
            ("tcp:// get(out=) (bulk)", f"{f(r['tw_tcp_bulk_get_gbps'], '.3f')} GB/s", ""),
            ("plain socket (bulk)", f"{f(r['socket_gbps'], '.3f')} GB/s", "baseline"),
            ("tcp:// 1 KiB get p50", f"{f(r['tw_tcp_small_get_us'], '.1f')} us", ""),
        ]
    if "mooncake_note" in r:
        rows += [
            ("Mooncake TCP write", f"{f(r['mooncake_write_gbps'], '.3f')} GB/s",
             f"tcp:// put {f(r['tw_tcp_vs_mooncake_write'], '.2f')} x; {r['mooncake_note']}"),
            ("Mooncake TCP read", f"{f(r['mooncake_read_gbps'], '.3f')} GB/s",
             f"tcp:// get {f(r['tw_tcp_vs_mooncake_read'], '.2f')} x"),
            ("Mooncake 1 KiB read p50", f"{f(r['mooncake_read_us'], '.1f')} us",
             f"{f(r['tw_tcp_vs_mooncake_read_us'], '.2f')} x tcp:// get's"),
        ]  # fmt: skip
    if "gloo_note" in r:
        rows += [
            ("gloo send (acked)", f"{f(r['gloo_send_gbps'], '.3f')} GB/s",
             f"tcp:// put {f(r['tw_tcp_vs_gloo'], '.2f')} x; {r['gloo_note']}"),
            ("gloo 1 KiB ping-pong p50", f"{f(r['gloo_us'], '.1f')} us",
             f"{f(r['tw_tcp_vs_gloo_us'], '.2f')} x tcp:// get's"),
        ]  # fmt: skip
    mib = int(r["size_bytes"] or 0) / MiB
    head = (
        f"tensorwire peers benchmark: bulk {mib:g} MiB, median of {r['iters']}; ratio > 1: tensorwire better"
    )
    return table(head, rows, value_width=16)


def main(argv: list[str] | None = None) -> Result:
    args = _parse_args(argv)
    return show(run(args), args.json, format_table)


if __name__ == "__main__":
    main(sys.argv[1:])
