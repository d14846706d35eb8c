"""Ping during a put: how long one client's large put makes another client's small request wait.

A server serves every connection on one event loop, so any stretch of one request's work that
does not give the loop a turn (receiving, checksums, copies, disk) delays every other client. This
measures it as a user sees it: while a child process puts one large tensor over ``tcp://``, this
process reads a 1 KiB tensor every few milliseconds on another connection and records each
round trip. The same pings with no put running are the baseline (``ping_idle_p99_ms``); the bound
the project holds itself to is ``ping_during_put_p99_ms`` under 50 ms for a 1 GiB put.

Used by ``bench/transfer.py`` (``--ping-put-size``); runnable alone:
``python -m tensorwire.bench.pinglag URL [SIZE_BYTES]``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

import torch

import tensorwire

PING_NAME = "bench/ping"
PUT_NAME = "bench/ping-put"
PING_EVERY = 0.003  # seconds between pings
PUTS = 2  # the second put replaces the first, as a training job's would
START_TIMEOUT = 120.0  # the child imports torch first
PUT_TIMEOUT = 600.0


def _putter(conn: Connection, url: str, nbytes: int) -> None:
    """Child: connect, say ready, then on "go" put ``nbytes`` PUTS times and report the seconds."""
    tensor = torch.ones(max(nbytes // 4, 1))
    with tensorwire.connect(url, timeout=PUT_TIMEOUT) as client:
        client.put(PUT_NAME + "/warm", torch.ones(256))
        conn.send("ready")
        conn.recv()
        start = time.perf_counter()
        for _ in range(PUTS):
            client.put(PUT_NAME, tensor)
        conn.send(time.perf_counter() - start)
        client.delete_many([PUT_NAME, PUT_NAME + "/warm"])


def _pings(client: tensorwire.Client, until: Callable[[], bool], least: int = 20) -> list[float]:
    """Round trips (seconds) of 1 KiB gets, one every PING_EVERY, until ``until()`` (at least ``least``)."""
    out = torch.zeros(256)
    samples: list[float] = []
    while len(samples) < least or not until():
        start = time.perf_counter()
        client.get(PING_NAME, out=out)
        samples.append(time.perf_counter() - start)
        time.sleep(PING_EVERY)
    return samples


def _p99_ms(samples: list[float]) -> float:
    ordered = sorted(samples)
    return 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def measure(url: str, nbytes: int) -> dict[str, float | int | None]:
    """Ping latency while another process puts ``nbytes`` (twice) into the server at ``url``."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_putter, args=(child, url, nbytes), name="ping-putter", daemon=True)
    proc.start()
    child.close()
    try:
        with tensorwire.connect(url) as client:
            client.put(PING_NAME, torch.ones(256))
            multiprocessing.connection.wait([parent, proc.sentinel], START_TIMEOUT)
            if not parent.poll() or parent.recv() != "ready":
                raise RuntimeError(f"the putter did not start in {START_TIMEOUT:.0f}s (exit {proc.exitcode})")
            idle_until = time.perf_counter() + 0.5
            idle = _pings(client, lambda: time.perf_counter() > idle_until)
            parent.send("go")
            busy = _pings(client, lambda: parent.poll() or not proc.is_alive())
            if not parent.poll():
                raise RuntimeError(f"the putter died (exit {proc.exitcode})")
            put_seconds = float(parent.recv())
            client.delete(PING_NAME)
    finally:
        parent.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return {
        "ping_during_put_p99_ms": _p99_ms(busy),
        "ping_during_put_p50_ms": 1e3 * statistics.median(busy),
        "ping_during_put_max_ms": 1e3 * max(busy),
        "ping_idle_p99_ms": _p99_ms(idle),
        "ping_put_bytes": nbytes,
        "ping_put_gbps": PUTS * nbytes / put_seconds / 1e9 if put_seconds > 0 else None,
        "ping_samples": len(busy),
    }


def rows(r: Mapping[str, object], fmt: Callable[[Any, str], str]) -> list[tuple[str, str, str]]:
    """Lines for the transfer benchmark's table; ``fmt`` is its number formatter."""
    size = r.get("ping_put_bytes")
    mib = f"{size / (1 << 20):g} MiB" if isinstance(size, int) else "?"
    return [
        (
            f"1 KiB get p99 during a {mib} put",
            f"{fmt(r.get('ping_during_put_p99_ms'), '.1f')} ms",
            f"target < 50; idle p99 {fmt(r.get('ping_idle_p99_ms'), '.2f')} ms",
        )
    ]


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        print(measure(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30))
