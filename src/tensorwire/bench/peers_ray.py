"""The Ray part of ``bench peers``: Ray's object store on one node next to tensorwire.

Ray, as a new user runs it: a local ``ray.init()`` (small object store, no dashboard; its start is
not timed), ``ray.put`` of a ``--ray-size`` numpy array from the driver, ``ray.get`` of such an
object into a preallocated buffer inside an actor (timed inside the actor), an actor call that
returns 1 KiB (round trip from the driver), and ``--many`` single ``ray.put`` s of 1 KiB. Next to
it, tensorwire over shm:// and tcp:// (a server in a child process): put, get(out=) of the same
size, a 1 KiB get round trip, and ``put_many`` of ``--many`` 1 KiB tensors (one call: what a user
would do with many small tensors; Ray has no batched put). Ratios above 1: tensorwire better.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from typing import Any

import numpy as np
import torch

import tensorwire
from tensorwire.bench.fastpaths import p50_us, ratio
from tensorwire.bench.transfer import _median_seconds
from tensorwire.types import KiB, MiB

Result = dict[str, float | int | str | None]
SMALL_BYTES = KiB
TRANSPORTS = ("shm", "tcp")
_TW = ("put_gbps", "get_gbps", "get_us", "small_per_s")
_VS = ("put", "get", "call", "small")
KEYS = (
    "ray_put_gbps", "ray_get_gbps", "ray_call_us", "ray_small_per_s",
    *(f"tw_{t}_{k}" for t in TRANSPORTS for k in _TW),
    *(f"tw_{t}_vs_ray_{k}" for t in TRANSPORTS for k in _VS),
)  # fmt: skip


def missing() -> str | None:
    """Why Ray cannot run here, or None."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed: pip install 'tensorwire[ray]' (or tensorwire[peers])"
    return None


def _getter_class(ray: Any) -> Any:
    @ray.remote(num_cpus=0)
    class Getter:
        """An actor with a preallocated buffer that ``ray.get`` s objects into it."""

        def __init__(self, nbytes: int) -> None:
            self.buf = np.ones(nbytes, dtype=np.uint8)  # pages faulted in now, not in the timing

        def get_into(self, refs: list[Any]) -> float:
            # A ref inside a list is not resolved by Ray before the call: the get is timed here.
            start = time.perf_counter()
            np.copyto(self.buf, ray.get(refs[0]))
            return time.perf_counter() - start

        def echo(self, payload: bytes) -> bytes:
            return payload

    return Getter


def ray_figures(args: argparse.Namespace) -> Result:
    """Ray's four figures; Ray is started and shut down here, its start outside the timing."""
    import ray

    store = max(128 * MiB, 6 * args.ray_size, 4 * args.many * SMALL_BYTES)
    ray.init(object_store_memory=store, include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        array = np.random.randint(0, 255, args.ray_size, dtype=np.uint8)
        getter = _getter_class(ray).remote(args.ray_size)
        ray.get(getter.echo.remote(b""))  # the actor's process has started
        put_s = _median_seconds(lambda: ray.put(array), args.iters)
        gets = []
        for _ in range(args.iters + 1):
            ref = ray.put(array)
            gets.append(ray.get(getter.get_into.remote([ref])))
            del ref
        payload = bytes(SMALL_BYTES)
        call_us = p50_us(lambda: ray.get(getter.echo.remote(payload)), min(args.small_iters, 500))
        small = np.ones(SMALL_BYTES, dtype=np.uint8)
        start = time.perf_counter()
        refs = [ray.put(small) for _ in range(args.many)]
        small_s = time.perf_counter() - start
        del refs
        return {
            "ray_put_gbps": args.ray_size / put_s / 1e9,
            "ray_get_gbps": args.ray_size / statistics.median(gets[1:]) / 1e9,
            "ray_call_us": call_us,
            "ray_small_per_s": args.many / small_s,
            "ray_version": ray.__version__,
        }
    finally:
        ray.shutdown()


def tw_figures(url: str, args: argparse.Namespace) -> dict[str, float]:
    """tensorwire doing what Ray did, over ``url``."""
    data = torch.rand(args.ray_size // 4)
    out = torch.zeros_like(data)
    small = {f"peers/small/{i:05d}": torch.rand(SMALL_BYTES // 4) for i in range(args.many)}
    with tensorwire.connect(url) as client:
        client.put("peers/x", data)  # the server's second buffer (it alternates two on overwrites)
        put_s = _median_seconds(lambda: client.put("peers/x", data), args.iters)
        get_s = _median_seconds(lambda: client.get("peers/x", out=out), args.iters)
        if not torch.equal(out, data):
            raise RuntimeError(f"peers/x came back different over {url}")
        client.put("peers/one", torch.rand(SMALL_BYTES // 4))
        one = torch.zeros(SMALL_BYTES // 4)
        get_us = p50_us(lambda: client.get("peers/one", out=one), args.small_iters)
        start = time.perf_counter()
        client.put_many(small)
        many_s = time.perf_counter() - start
    return {
        "put_gbps": args.ray_size / put_s / 1e9,
        "get_gbps": args.ray_size / get_s / 1e9,
        "get_us": get_us,
        "small_per_s": args.many / many_s,
    }


def measure(urls: list[str], args: argparse.Namespace) -> Result:
    """Ray's figures and tensorwire's over shm:// and tcp:// (``urls``: the server's, tcp first)."""
    by_scheme = {url.split(":", 1)[0]: url for url in urls}
    result: Result = {}
    for t in TRANSPORTS:
        tw = tw_figures(by_scheme[t], args)
        result.update({f"tw_{t}_{k}": v for k, v in tw.items()})
    result.update(ray_figures(args))
    for t in TRANSPORTS:
        g = result.get
        result[f"tw_{t}_vs_ray_put"] = ratio(g(f"tw_{t}_put_gbps"), g("ray_put_gbps"))  # type: ignore[arg-type]
        result[f"tw_{t}_vs_ray_get"] = ratio(g(f"tw_{t}_get_gbps"), g("ray_get_gbps"))  # type: ignore[arg-type]
        result[f"tw_{t}_vs_ray_call"] = ratio(g("ray_call_us"), g(f"tw_{t}_get_us"))  # type: ignore[arg-type]
        result[f"tw_{t}_vs_ray_small"] = ratio(g(f"tw_{t}_small_per_s"), g("ray_small_per_s"))  # type: ignore[arg-type]
    result["ray_note"] = f"Ray {result.pop('ray_version')} local; tensorwire small puts: one put_many"
    return result


def rows(r: Result, f: Any) -> list[tuple[str, str, str]]:
    """The table rows of the Ray figures; ``f`` is the table's number formatter."""
    if "ray_note" not in r:
        return []
    if r["ray_put_gbps"] is None:
        return [("Ray", "n/a", str(r["ray_note"]))]
    out = [
        ("Ray put", f"{f(r['ray_put_gbps'], '.3f')} GB/s", str(r.get("ray_note", ""))),
        ("Ray get in an actor", f"{f(r['ray_get_gbps'], '.3f')} GB/s", ""),
        ("Ray 1 KiB actor call p50", f"{f(r['ray_call_us'], '.1f')} us", ""),
        ("Ray small puts", f"{f(r['ray_small_per_s'], ',.0f')} /s", "single ray.put each"),
    ]
    for t in TRANSPORTS:
        out += [
            (f"{t}:// put", f"{f(r[f'tw_{t}_put_gbps'], '.3f')} GB/s",
             f"{f(r[f'tw_{t}_vs_ray_put'], '.2f')} x Ray"),
            (f"{t}:// get(out=)", f"{f(r[f'tw_{t}_get_gbps'], '.3f')} GB/s",
             f"{f(r[f'tw_{t}_vs_ray_get'], '.2f')} x Ray"),
            (f"{t}:// 1 KiB get p50", f"{f(r[f'tw_{t}_get_us'], '.1f')} us",
             f"{f(r[f'tw_{t}_vs_ray_call'], '.2f')} x faster than the actor call"),
            (f"{t}:// put_many 1 KiB", f"{f(r[f'tw_{t}_small_per_s'], ',.0f')} /s",
             f"{f(r[f'tw_{t}_vs_ray_small'], '.2f')} x Ray"),
        ]  # fmt: skip
    return out
