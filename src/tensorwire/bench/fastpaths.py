"""The fast paths of ``bench transfer``: striping, lossless compression, the client cache, and the
iperf3 ceiling of one TCP stream. Each figure comes with its baseline from the same run:

* ``striped_gbps`` vs ``one_stream_gbps`` (``striped_ratio``): put + get of the bulk tensor over
  K connections vs one (K as the client picks it: ``stripes=0``).
* ``lz4_gbps`` / ``zstd_gbps`` vs ``raw_compressible_gbps`` (``lz4_ratio``, ``zstd_ratio``): put +
  get of a sparse gradient (90% zeros) with that codec vs uncompressed.
* ``auto_incompressible_ratio``: ``compression="auto"`` on random floats vs uncompressed (the
  target: never below 0.95).
* ``cache_hit_get_us``: p50 of a cached 1 KiB get (one STAT), next to ``cache_leased_get_us``
  (within a lease: no request) and ``cache_miss_get_us`` (a plain get).
* ``iperf_gbps``: iperf3, one TCP stream on loopback, when iperf3 is installed (else null, and
  ``iperf_note`` says why); ``put_vs_iperf`` / ``get_vs_iperf``: tcp:// put/get over it (``iperf``).

Rounds of the compared configurations are interleaved and their medians taken, so a burst of
load from elsewhere hits both sides of a ratio alike.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import tensorwire
from tensorwire.types import KiB, MiB

Result = dict[str, float | int | str | None]
COMPRESSIBLE_MAX = 64 * MiB
IPERF_SECONDS = 2


@contextmanager
def _unpinned() -> Iterator[None]:
    """Striping exists to use several cores: let this thread (and the lanes it starts) use them all."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _round_trip_s(client: tensorwire.Client, name: str, data: torch.Tensor, out: torch.Tensor) -> float:
    start = time.perf_counter()
    client.put(name, data)
    client.get(name, out=out)
    return time.perf_counter() - start


def _interleaved(
    clients: dict[str, tensorwire.Client], name: str, data: torch.Tensor, iters: int
) -> dict[str, float]:
    """GB/s (put + get, bytes both ways) of each client on the same tensor, rounds interleaved."""
    out = torch.empty_like(data)
    out.zero_()
    times: dict[str, list[float]] = {key: [] for key in clients}
    for client in clients.values():  # warm-up: connections, lanes, server buffers
        _round_trip_s(client, name, data, out)
        _round_trip_s(client, name, data, out)
    for _ in range(iters):
        for key, client in clients.items():
            times[key].append(_round_trip_s(client, name, data, out))
    if not torch.equal(out, data):
        raise RuntimeError(f"{name} came back different from what was put")
    nbytes = 2 * data.numel() * data.element_size()
    return {key: nbytes / statistics.median(t) / 1e9 for key, t in times.items()}


def ratio(value: float | None, baseline: float | None) -> float | None:
    """``value / baseline``, None when either is missing or zero."""
    return value / baseline if value and baseline else None


def striping(url: str, data: torch.Tensor, iters: int) -> Result:
    nbytes = data.numel() * data.element_size()
    with _unpinned():
        striped = tensorwire.connect(url, stripes=0, stripe_bytes=min(nbytes, 64 * MiB))
        one = tensorwire.connect(url, stripes=1)
        try:
            gbps = _interleaved({"striped": striped, "one": one}, "bench/x", data, iters)
            lanes = striped._async._transfers.lanes
            k = len(lanes.lanes) if lanes is not None else 1
        finally:
            striped.close()
            one.close()
    return {
        "striped_gbps": gbps["striped"],
        "one_stream_gbps": gbps["one"],
        "striped_ratio": ratio(gbps["striped"], gbps["one"]),
        "stripes": k,
    }


def sparse_gradient(nbytes: int) -> torch.Tensor:
    g = torch.zeros(max(nbytes // 4, 1))
    g[::10] = torch.randn(g[::10].numel())
    return g


def compression(url: str, size: int, iters: int) -> Result:
    sparse = sparse_gradient(min(size, COMPRESSIBLE_MAX))
    noise = torch.randn(min(size, COMPRESSIBLE_MAX) // 4)
    modes = ("none", "lz4", "zstd", "auto")
    clients = {mode: tensorwire.connect(url, compression=mode, stripes=1) for mode in modes}
    try:
        comp = _interleaved({m: clients[m] for m in ("none", "lz4", "zstd")}, "bench/sparse", sparse, iters)
        incomp = _interleaved({m: clients[m] for m in ("none", "auto")}, "bench/noise", noise, iters)
    finally:
        for client in clients.values():
            client.close()
    return {
        "compressible_bytes": sparse.numel() * 4,
        "raw_compressible_gbps": comp["none"],
        "lz4_gbps": comp["lz4"],
        "zstd_gbps": comp["zstd"],
        "lz4_ratio": ratio(comp["lz4"], comp["none"]),
        "zstd_ratio": ratio(comp["zstd"], comp["none"]),
        "raw_incompressible_gbps": incomp["none"],
        "auto_incompressible_gbps": incomp["auto"],
        "auto_incompressible_ratio": ratio(incomp["auto"], incomp["none"]),
    }


def p50_us(fn: Callable[[], object], iters: int) -> float:
    """Median microseconds of ``fn`` over ``iters`` calls, after a tenth as many warm-ups (5 or more)."""
    for _ in range(max(iters // 10, 5)):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1e3


def cache(url: str, iters: int) -> Result:
    small = torch.rand(KiB // 4)
    with (
        tensorwire.connect(url, cache_bytes=MiB) as checked,
        tensorwire.connect(url, cache_bytes=MiB, cache_lease=3600.0) as leased,
        tensorwire.connect(url) as plain,
    ):
        plain.put("bench/cached", small)
        out = torch.empty_like(small)
        return {
            "cache_hit_get_us": p50_us(lambda: checked.get("bench/cached", out=out), iters),
            "cache_leased_get_us": p50_us(lambda: leased.get("bench/cached", out=out), iters),
            "cache_miss_get_us": p50_us(lambda: plain.get("bench/cached", out=out), iters),
        }


IPERF_MISSING = "iperf3 is not installed (apt-get install iperf3)"
IPERF_TRIES = 3


def iperf_gbps(seconds: int = IPERF_SECONDS) -> tuple[float | None, str]:
    """One TCP stream on loopback as iperf3 measures it, and how it went: (None, why) when iperf3
    is not installed or no try gave a figure (iperf3 can exit 0 with a report that lacks one)."""
    iperf = shutil.which("iperf3")
    if iperf is None:
        return None, IPERF_MISSING
    why = "no try ran"
    for _ in range(IPERF_TRIES):
        gbps, why = _iperf_once(iperf, seconds)
        if gbps is not None:
            return gbps, why
    return None, f"iperf3 gave no figure in {IPERF_TRIES} tries: {why}"


def _iperf_once(iperf: str, seconds: int) -> tuple[float | None, str]:
    with socket.socket() as probe:  # a free port (a race with another program is harmless here)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [iperf, "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    why = "the iperf3 server never answered"
    try:
        for _ in range(50):  # the server needs a moment to listen
            try:
                client = subprocess.run(
                    [iperf, "-c", "127.0.0.1", "-p", str(port), "-t", str(seconds), "-J"],
                    capture_output=True,
                    text=True,
                    timeout=seconds + 30,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return None, f"the iperf3 client ran past {seconds + 30} s"
            if client.returncode == 0:
                return iperf_report_gbps(client.stdout)
            why = f"iperf3 exited {client.returncode}: {client.stderr.strip()[-200:]}"
            time.sleep(0.1)
        return None, why
    finally:
        server.kill()
        server.wait(10)


def iperf_report_gbps(text: str) -> tuple[float | None, str]:
    """GB/s from iperf3's ``-J`` report: ``end.sum_received``, else ``end.sum_sent`` (a report
    that lacks the first was seen), else (None, why)."""
    try:
        report: Any = json.loads(text)
    except ValueError:
        return None, "iperf3's report is not JSON"
    end = report.get("end") if isinstance(report, dict) else None
    for key in ("sum_received", "sum_sent"):
        total = end.get(key) if isinstance(end, dict) else None
        bps = total.get("bits_per_second") if isinstance(total, dict) else None
        if isinstance(bps, int | float) and bps > 0:
            return float(bps) / 8e9, f"iperf3 one stream, end.{key}"
    error = report.get("error") if isinstance(report, dict) else None
    return None, f"iperf3's report has no end.sum_received/sum_sent{f' ({error})' if error else ''}"


def measure(url: str, data: torch.Tensor, iters: int, small_iters: int) -> Result:
    """Every fast-path figure against the tcp:// server at ``url``."""
    size = data.numel() * data.element_size()
    return {
        **striping(url, data, iters),
        **compression(url, size, iters),
        **cache(url, small_iters),
    }


def iperf(put_gbps: float, get_gbps: float) -> Result:
    """iperf3's one stream and tcp:// put/get over it (None, with ``iperf_note``, where it cannot)."""
    gbps, note = iperf_gbps()
    return {
        "iperf_gbps": gbps,
        "put_vs_iperf": ratio(put_gbps, gbps),
        "get_vs_iperf": ratio(get_gbps, gbps),
        "iperf_note": note,
    }
