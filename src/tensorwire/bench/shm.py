"""The shared-memory part of ``tensorwire bench transfer``: ``shm://`` put and get next to the
ceiling of any same-host path, a memcpy of the same bytes into the same preallocated (touched)
tensor that the gets land in, measured in the same run, interleaved with the puts and gets.

Targets (issue 6): ``shm_get_ratio`` (get into ``out=`` / memcpy) >= 0.6 and ``shm_put_ratio``
>= 0.4, with warm segments: the timed puts and gets reuse segments already mapped on both sides.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

import tensorwire
from tensorwire.wire.tensors import byte_view

Result = dict[str, float | int | str | None]


def measure(client: tensorwire.Client, data: torch.Tensor, iters: int, name: str = "bench/shm") -> Result:
    """shm put, get into ``out=`` and the memcpy baseline, interleaved (one of each per round) so
    that all three see the same load on a shared machine; medians of ``iters`` rounds."""
    if client.transport != "shm":
        raise ValueError(f"the shm benchmark needs an shm:// client, not {client.url}")
    src = byte_view(data)
    out = torch.empty_like(data)
    out.zero_()  # touched once: the timed copies measure copies, not page faults
    dst = byte_view(out)
    for _ in range(2):  # an overwrite alternates between two segments: warm both
        client.put(name, data)
    client.get(name, out=out)
    times: dict[str, list[float]] = {"put": [], "get": [], "memcpy": []}

    def copy() -> None:
        dst[:] = src  # the copy a get makes, without the protocol around it

    steps: dict[str, Callable[[], object]] = {
        "put": lambda: client.put(name, data),
        "get": lambda: client.get(name, out=out),
        "memcpy": copy,
    }
    for _ in range(iters):
        for kind, step in steps.items():
            start = time.perf_counter()
            step()
            times[kind].append(time.perf_counter() - start)
    client.get(name, out=out)
    if not torch.equal(out, data):
        raise RuntimeError(f"{name} came back different from what was put")
    put, get, memcpy = (src.nbytes / statistics.median(times[k]) / 1e9 for k in ("put", "get", "memcpy"))
    return fields(put, get, memcpy)


def fields(put_gbps: float, get_gbps: float, memcpy: float) -> Result:
    return {
        "shm_put_gbps": put_gbps,
        "shm_get_gbps": get_gbps,
        "memcpy_gbps": memcpy,
        "shm_put_ratio": put_gbps / memcpy if memcpy > 0 else None,
        "shm_get_ratio": get_gbps / memcpy if memcpy > 0 else None,
    }


def rows(r: Result, fmt: object) -> list[tuple[str, str, str]]:
    """The table rows of the shm figures; ``fmt`` is the table's number formatter."""
    f = fmt  # (value, spec) -> str
    assert callable(f)
    return [
        (
            "put over shm://",
            f"{f(r['shm_put_gbps'], '.3f')} GB/s",
            f"{f(r['shm_put_ratio'], '.2f')} x memcpy",
        ),
        (
            "get(out=) over shm://",
            f"{f(r['shm_get_gbps'], '.3f')} GB/s",
            f"{f(r['shm_get_ratio'], '.2f')} x memcpy",
        ),
        ("memcpy (same bytes, same out)", f"{f(r['memcpy_gbps'], '.3f')} GB/s", "baseline"),
    ]


__all__: Sequence[str] = ["fields", "measure", "rows"]
