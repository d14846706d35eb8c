"""The shared-memory part of ``tensorwire bench transfer``: ``shm://`` put and get next to the
ceiling of any same-host path, a memcpy into a preallocated buffer of the same size, measured in
the same run (``numpy.copyto``, both buffers touched beforehand, so no page faults are timed).

Targets (issue 6): ``shm_get_ratio`` (get into ``out=`` / memcpy) >= 0.6 and ``shm_put_ratio``
>= 0.4, with warm segments: the timed puts and gets reuse segments already mapped on both sides.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

Result = dict[str, float | int | str | None]


def memcpy_gbps(data: torch.Tensor, iters: int) -> float:
    """GB/s of one copy of ``data``'s bytes into a preallocated, already touched buffer."""
    src = data.numpy().view(np.uint8).reshape(-1)
    dst = np.empty_like(src)
    dst.fill(0)  # fault the pages in: the timed copies measure the copy
    np.copyto(dst, src)  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return src.nbytes / statistics.median(times) / 1e9


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
        ("memcpy (numpy, same size)", f"{f(r['memcpy_gbps'], '.3f')} GB/s", "baseline"),
    ]


__all__: Sequence[str] = ["fields", "memcpy_gbps", "rows"]
